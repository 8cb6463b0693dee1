"""``benchmarks/weight_sync.py`` end to end on a small model: both placements, each with its own real
server, and the figures it ends with (values are not asserted: they are wall-clock ratios)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from bridge_helpers import run_benchmark


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the split placement needs 2 cores")
def test_benchmark_measures_both_placements_and_ends_with_the_goal_figure(tmp_path: Path) -> None:
    proc = run_benchmark(
        "weight_sync.py",
        *("--work-dir", str(tmp_path), "--layers", "1", "--hidden", "128", "--vocab", "512"),
        *("--reps", "2", "--first-bucket-mb", "0.1"),
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines[-3:]] == [
        "shared-core sync efficiency",
        "quantize efficiency",
        "sync efficiency",
    ]
    for line in lines[-3:]:
        assert float(line.rsplit(": ", 1)[1]) > 0
    mine = sorted(os.sched_getaffinity(0))
    assert "== placement shared: server and trainer share every core" in proc.stdout
    assert f"== placement split: server on core {mine[-1]}, trainer on {mine[:-1]}" in proc.stdout
    # Each placement ran its reps on its own server, with the bridge's buckets.
    assert len(re.findall(r"^\[shared\] rep \d+: raw .* \d+ buckets fp8=fake-quant", proc.stdout, re.M)) == 2
    assert len(re.findall(r"^\[split\] rep \d+: raw .* \d+ buckets fp8=fake-quant", proc.stdout, re.M)) == 2
    assert (tmp_path / "sglang-split.log").is_file() and (tmp_path / "sglang-shared.log").is_file()


@pytest.mark.parametrize(
    ("placements", "message"),
    [
        ("split,nope", "--placements: unknown placement 'nope'; use split and/or shared"),
        ("split,split", "--placements 'split,split': give split and/or shared, each once"),
        (",", "--placements ',': give split and/or shared, each once"),
    ],
)
def test_benchmark_refuses_bad_placements(tmp_path: Path, placements: str, message: str) -> None:
    proc = run_benchmark(
        "weight_sync.py", "--work-dir", str(tmp_path), "--placements", placements, timeout=300
    )
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not (tmp_path / "models").exists()  # refused before any model was built
