"""Shared test set-up: CPU tests by default; `gpu` tests skip without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, settings

# tests/ holds helper modules (float64 references, launchers) imported by the test files.
sys.path.insert(0, str(Path(__file__).parent))

# `make mutate` (--hypothesis-profile=mutate): the same examples for every mutant, no example database
# carried between mutants, and no shrinking -- a failing example already kills the mutant.
settings.register_profile(
    "mutate", derandomize=True, database=None, phases=[Phase.explicit, Phase.reuse, Phase.generate]
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
