"""Helpers of the bridge tests: fixed prompts, running a benchmark script; the HF reference is
``sglang_bridge.hf_reference``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from sglang_bridge.hf_reference import hf_logprobs, load_hf
from sglang_bridge.weight_sync import Manifest

PROMPTS = [[5, 17, 42, 99, 7, 120, 33], [3, 1, 4, 1, 5, 9, 2, 6], [200, 201, 202]]

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["PROMPTS", "hf_logprobs", "hf_named_tensors", "load_hf", "run_benchmark"]


def run_benchmark(name: str, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/<name>`` with this interpreter from the repository root; stdout/stderr captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def hf_named_tensors(model: torch.nn.Module, manifest: Manifest) -> dict[str, torch.Tensor]:
    """HF state dict as the server holds it: tied copies (lm_head.weight) dropped."""
    return {k: v for k, v in model.state_dict().items() if k not in manifest.tied}
