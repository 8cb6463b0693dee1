"""``benchmarks/fp8_logprob_gap.py`` end to end: two real SGLang servers, the bridge, verify.

On CPU the FP8 server is a bf16 server fed fake-quant weights; with a GPU (``gpu`` marker) it serves
the real FP8 copy of the checkpoint and the bridge sends e4m3 + scales over NCCL: the issue's GPU
proof, as one prepared script.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from bridge_helpers import run_benchmark


def _run(tmp_path: Path, *args: str) -> dict[str, float]:
    proc = run_benchmark("fp8_logprob_gap.py", "--work-dir", str(tmp_path), *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("fp8 logprob gap: "), lines[-5:]  # the goal figure, last
    figures = dict(re.findall(r"^(\w[\w ()]*): ([-+0-9.e]+)$", proc.stdout, re.M))
    assert "fp8=fake-quant" in proc.stdout or "fp8=real" in proc.stdout
    return {k: float(v) for k, v in figures.items()}


@pytest.mark.slow  # runs the benchmark end to end (~45 s)
def test_fp8_gap_on_cpu_is_fake_quant_and_above_the_bf16_control(tmp_path: Path) -> None:
    f = _run(
        tmp_path, "--device", "cpu", "--layers", "2", "--hidden", "128", "--vocab", "512",
        "--prompts", "8", "--new-tokens", "16", "--block", "32",
    )  # fmt: skip
    # The control server matches the trainer's forward as closely as every other bridge test asks;
    # the FP8-rounded weights move the log-probs clearly more (seeded: 0.0008 vs 0.008 here).
    assert f["bf16 logprob gap"] < 1e-2
    assert f["fp8 logprob gap"] > 2 * f["bf16 logprob gap"]
    assert f["fp8 logprob gap (max)"] >= f["fp8 logprob gap"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang with its GPU kernels")
def test_fp8_gap_with_real_fp8_served_on_gpu(tmp_path: Path) -> None:
    f = _run(tmp_path, "--device", "cuda")
    assert 0 < f["fp8 logprob gap"] < 1.0 and f["bf16 logprob gap"] < 0.05
