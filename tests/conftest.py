"""Shared test set-up: CPU tests by default; `gpu` tests skip without CUDA; one tiny checkpoint and
two real SGLang servers started once per session and shared by every test that asks for them.

Server start-up is ~25 s on 2 cores, so the session starts both servers concurrently on first use:
``sglang_server`` (tests that change weights restore them) and ``victim_server`` (the one killed by
the bridge's fault-injection test). The ServerGroup context manager stops both even when a test
fails or the run is interrupted.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, settings

from megatron_acrl.config import ModelConfig
from megatron_acrl.warmstart.tiny_model import build_checkpoint
from sglang_bridge.server import ServerGroup, ServerSpec, SGLangServer

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


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(ModelConfig(), seed=0, cache_dir=tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def server_group(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerGroup]:
    spec = ServerSpec(model_path=str(tiny_ckpt), device="cpu")
    logs = tmp_path_factory.mktemp("sglang-logs")
    with ServerGroup([spec, spec], log_dir=logs, startup_timeout_s=240) as group:
        yield group


@pytest.fixture(scope="session")
def sglang_server(server_group: ServerGroup) -> SGLangServer:
    return server_group.servers[0]


@pytest.fixture(scope="session")
def victim_server(server_group: ServerGroup) -> SGLangServer:
    return server_group.servers[1]
