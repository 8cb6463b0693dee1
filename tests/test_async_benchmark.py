"""The async benchmark's smoke run: the same path as the goal measurement (sync and async driver
runs, each with its own pinned SGLang server), in a few steps; its figures mean nothing here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_async_step_smoke_prints_the_goal_figure_last():
    cpus = sorted(os.sched_getaffinity(0))
    trainer, server = str(cpus[0]), str(cpus[-1])  # one core each where there are two
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "async_step.py"), "--smoke"]
        + ["--trainer-cpus", trainer, "--server-cpus", server],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    lines = res.stdout.strip().splitlines()
    assert re.fullmatch(r"async speedup: \d+\.\d+", lines[-1]), lines[-5:]
    assert any(x.startswith("ideal speedup: ") for x in lines)
    assert any(x.startswith("sync :") for x in lines) and any(x.startswith("async:") for x in lines)
