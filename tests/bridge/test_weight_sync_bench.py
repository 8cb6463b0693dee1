"""``benchmarks/weight_sync.py`` end to end on a small model: both placements, each with its own real
server, and the figures it ends with (values are not asserted: they are wall-clock ratios)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from bridge_helpers import run_benchmark


@pytest.mark.slow  # runs the benchmark end to end (~70 s)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the split placement needs 2 cores")
def test_benchmark_measures_both_placements_and_ends_with_the_goal_figure(tmp_path: Path) -> None:
    proc = run_benchmark(
        "weight_sync.py",
        *(
            "--work-dir",
            str(tmp_path),
            "--layout",
            "pp1",
            "--layers",
            "1",
            "--hidden",
            "128",
            "--vocab",
            "512",
        ),
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


# Two 4-rank Megatron launches and a server (~100 s): slow tier, to keep the default suite under
# its 30 minutes; the layouts' sync itself is in the default tier (tests/test_e2e.py, per source).
@pytest.mark.slow
def test_benchmark_layouts_smoke_run_ends_with_each_layouts_goal_figures(tmp_path: Path) -> None:
    """``--smoke --layout pp2,ep2``: both real Megatron layouts (torchrun, gloo) against real
    servers, the rank-0 path and the per-source path alternating; the goal lines come last."""
    proc = run_benchmark(
        "weight_sync.py", "--smoke", "--layout", "pp2,ep2", "--work-dir", str(tmp_path), timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert [line.rsplit(":", 1)[0] for line in lines[-4:]] == [
        "busiest rank bytes share [pp2]",
        "per-source sync time ratio [pp2]",
        "busiest rank bytes share [ep2]",
        "per-source sync time ratio [ep2]",
    ]
    figures = {line.rsplit(":", 1)[0]: float(line.rsplit(": ", 1)[1]) for line in lines[-4:]}
    # Bytes are not wall-clock: the busiest source sends about one stage's (one EP rank's) share.
    assert 0.3 < figures["busiest rank bytes share [pp2]"] <= 0.55, figures
    assert 0.3 < figures["busiest rank bytes share [ep2]"] < 1.0, figures
    assert figures["per-source sync time ratio [pp2]"] > 0
    assert len(re.findall(r"^\[pp2\] rep \d+: rank-0 path .*, per-source ", proc.stdout, re.M)) == 2
    assert "rank-0 path: rank 0 sends" in proc.stdout and "per-source: 2 sources" in proc.stdout


def test_benchmark_refuses_a_bad_layout(tmp_path: Path) -> None:
    proc = run_benchmark("weight_sync.py", "--work-dir", str(tmp_path), "--layout", "pp3", timeout=300)
    assert proc.returncode != 0
    assert "--layout 'pp3': give each of pp2, ep2, pp2ep2, pp1 at most once" in proc.stderr
    assert not (tmp_path / "models").exists()


def test_paper_table_counts_the_bytes_of_each_layout() -> None:
    proc = run_benchmark("weight_sync_paper.py", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| Qwen")]
    assert {r.split(" | ")[0] for r in rows} == {
        "| Qwen2.5-7B",
        "| Qwen3-30B-A3B",
        "| Qwen3-235B-A22B (shape)",
    }


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
