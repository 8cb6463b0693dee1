"""The scale benchmarks end to end on short settings: ``benchmarks/rollout_client.py``,
``benchmarks/routing.py`` (real servers, a real sglang-router) and ``benchmarks/microbatch.py`` (a
real Megatron rank). Values are not asserted: they are wall-clock ratios on a shared machine; the
figures must be there, named as the issue names them, last. The two server benchmarks are slow-tier
(their parts run in the default tier through tests/bridge/test_routing.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bridge_helpers import run_benchmark

TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins a server to each of 2 cores")


def _figure(stdout: str, name: str) -> float:
    last = stdout.strip().splitlines()[-1]
    assert last.startswith(f"{name}: "), stdout[-2000:]
    return float(last.rsplit(": ", 1)[1])


@pytest.mark.slow  # ~2 min: a server start and 4 runs
def test_rollout_client_benchmark(tmp_path: Path) -> None:
    proc = run_benchmark(
        "rollout_client.py",
        *("--prompts", "8", "--n", "2", "--max-new-tokens", "8", "--concurrency", "4", "--reps", "2"),
        *("--work-dir", str(tmp_path)),
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _figure(proc.stdout, "client efficiency") > 0
    assert "ours: " in proc.stdout and "bare: " in proc.stdout and "tokens/s" in proc.stdout


@pytest.mark.slow  # ~1.5 min: two servers, a router, 3 strategies
@TWO_CORES
def test_routing_benchmark(tmp_path: Path) -> None:
    proc = run_benchmark(
        "routing.py",
        *("--groups", "12", "--n", "2", "--median-tokens", "8", "--max-tokens", "24"),
        *("--concurrency", "2", "--reps", "1", "--work-dir", str(tmp_path)),
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _figure(proc.stdout, "routing efficiency") > 0
    for strategy in ("round_robin", "least_outstanding", "sglang_router"):
        assert f"{strategy}: makespan" in proc.stdout and "balanced ideal" in proc.stdout
    assert "least_outstanding vs round_robin makespan" in proc.stdout


def test_microbatch_benchmark() -> None:
    proc = run_benchmark(
        "microbatch.py",
        *("--prompts", "2", "--n", "4", "--max-new-tokens", "96", "--hidden", "64", "--reps", "1"),
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _figure(proc.stdout, "train time ratio") > 0
    fractions = {
        line.split()[2].rstrip(":"): float(line.rsplit(" ", 1)[1])
        for line in proc.stdout.splitlines()
        if line.startswith("padding fraction ")
    }
    assert fractions["budget"] < fractions["fixed"]  # a plan property, not a timing
    assert "peak activation memory" in proc.stdout


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("rollout_client.py", ("--reps", "0"), "--reps must be >= 1"),
        ("routing.py", ("--groups", "0"), "--groups must be >= 1"),
        ("routing.py", ("--policy", "manual"), "invalid choice: 'manual'"),
        ("microbatch.py", ("--prompts", "3", "--n", "1"), "multiple of --micro-batch-size"),
    ],
)
def test_benchmarks_refuse_bad_settings(script: str, args: tuple[str, ...], message: str) -> None:
    proc = run_benchmark(script, *args, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
