"""Shared helpers of the launch tests: the real local SLURM cluster fixture and job polling."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import slurm_local

ROOT = Path(__file__).resolve().parents[1]
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


@pytest.fixture(scope="session")
def slurm():
    """A real single-node SLURM cluster on loopback (installed with apt-get when missing and root)."""
    try:
        cluster = slurm_local.up()
    except slurm_local.SlurmUnavailable as err:
        pytest.skip(f"no local SLURM cluster: {err}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    yield cluster
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    if cluster.started:  # a cluster someone else started stays up
        slurm_local.down(cluster.dir)


def queued_jobs() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=10, check=True)
    return set(out.stdout.split())


def job_info(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=10
    )
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}


def wait_job(job_id: str, timeout_s: float = 180.0) -> dict[str, str]:
    """Poll `scontrol show job` until the job is finished for good (a requeued job goes PENDING again).

    sbatch --wait polls slowly and there is no sacct here, hence polling; the timeout only guards
    against a hung test, nothing is asserted about time.
    """
    deadline = time.monotonic() + timeout_s
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info.get("JobState") in TERMINAL:
            return info
        time.sleep(0.3)
    subprocess.run(["scancel", job_id], timeout=10)
    raise AssertionError(f"job {job_id} not finished in {timeout_s} s: {info}")


def submit(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `python -m launch.submit ARGS` from the repository root (as a user would)."""
    return subprocess.run(
        [sys.executable, "-m", "launch.submit", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def job_id_of(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"submitted job (\d+)", proc.stdout)
    assert m, proc.stdout
    return m.group(1)
