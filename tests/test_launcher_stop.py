"""Stopping and crashing a real two-rank ``python -m launch.torchrun`` run (issue #25).

The ranks run ``megatron_acrl.train`` (real Megatron trainer, real distributed checkpoints, W&B
offline) on recorded rollouts made here, no server; ``tests/stop_runner.py`` holds the k-th step
until the test's signal has reached the ranks, or SIGKILLs a rank there. What must hold:

* SIGTERM to the launcher (``kill``, a scheduler, ``docker stop``) or Ctrl-C on its process group:
  the step is checkpointed, the launcher exits 0, and the resumed run logs every step exactly once,
  in ``metrics.jsonl`` and in W&B alike, with the values of an uninterrupted run.
* A rank SIGKILLed between two checkpoints: the job fails, no child process of the dead rank
  (megatron's checkpoint writer) outlives it, and the run resumed from the earlier checkpoint logs
  every step exactly once, the crashed attempt's later rows kept aside.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from stop_runner import record_rollouts

from megatron_acrl.logging import SUPERSEDED, read_jsonl_metrics, read_wandb_history
from megatron_acrl.megatron.step_manifest import select_step_dir

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "tiny_dense.yaml")
STEPS = 5
OVERRIDES = [
    f"training.num_steps={STEPS}",
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=4",
    "training.micro_batch_size=4",
    "rollout.max_prompt_len=16",
    "task.num_digits=1",
    "logging.wandb_mode=offline",
    "logging.console=false",
]
LIMIT_S = 600
"""A bound on each wait, so that a broken run fails the test instead of hanging it (not a timing)."""
NOT_COMPARED = ("time/", "perf/", "sync/seconds")


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory) -> Path:
    return record_rollouts(tmp_path_factory.mktemp("rollouts"), STEPS)


def test_the_launcher_gives_the_ranks_time_to_checkpoint_unless_told_otherwise():
    from launch.torchrun import STOP_GRACE_S, stop_args

    argv = ["--standalone", "--nproc-per-node", "2", "-m", "megatron_acrl.train", "--shutdown-timeout"]
    assert stop_args(argv) == (["--shutdown-timeout", str(STOP_GRACE_S), *argv], False)  # the script's own
    given = ["--shutdown-timeout=7", "--ranks-get-stop-signals", "--nnodes=1", "--no-python", "bash", "w.sh"]
    assert stop_args(given) == (["--shutdown-timeout=7", "--nnodes=1", "--no-python", "bash", "w.sh"], True)


class Launch:
    """One ``python -m launch.torchrun --standalone --nproc-per-node 2`` run, in its own session
    (so that Ctrl-C can be sent to its process group as a terminal would)."""

    def __init__(self, tmp: Path, rollouts: Path, run: str, faults: dict | None = None, extra=()):
        self.marker = tmp / f"{run}-marker.json"
        self.log = tmp / f"{run}-launcher.log"
        self.run_dir = tmp / "run"
        faults = {"at_train_step": 10**6, "action": "pause", **(faults or {}), "marker": str(self.marker)}
        cmd = [
            sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node", "2",
            str(ROOT / "tests" / "stop_runner.py"), json.dumps(faults),
            "--config", CONFIG, "--run-dir", str(self.run_dir), "--load-rollouts", str(rollouts),
            f"training.checkpoint_dir={tmp / 'ck'}", *OVERRIDES, *extra,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def at_fault(self) -> dict:
        """Wait until the faulty rank is at its step; what it wrote (pids) about itself."""
        deadline = time.monotonic() + LIMIT_S
        while not self.marker.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"the run ended before its fault (rc {self.proc.poll()}):\n{self.output()}")
            time.sleep(0.1)
        return json.loads(self.marker.read_text())

    def wait(self) -> int:
        try:
            return self.proc.wait(LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            pytest.fail(f"the launcher did not exit:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text()[-8000:]

    def steps(self) -> list[int]:
        return [r["step"] for r in read_jsonl_metrics(self.run_dir / "metrics.jsonl")]


def _stop(tmp: Path, rollouts: Path, how: str, at: int = 3) -> Launch:
    """Start a run and stop it through the launcher during step ``at``; it must checkpoint there."""
    first = Launch(tmp, rollouts, "stopped", {"at_train_step": at})
    first.at_fault()
    if how == "sigterm":
        os.kill(first.proc.pid, signal.SIGTERM)  # kill, a scheduler, a container runtime
    else:
        os.killpg(first.proc.pid, signal.SIGINT)  # Ctrl-C in the launcher's terminal
    rc = first.wait()
    out = first.output()
    assert rc == 0, out
    assert "every rank checkpointed and exited 0" in out
    assert "BrokenPipe" not in out and "Traceback" not in out, out
    assert select_step_dir(tmp / "ck").step == at  # the step it was in, not a periodic one
    assert first.steps() == list(range(1, at + 1))
    return first


def test_sigterm_to_the_launcher_checkpoints_the_step_and_resumes_each_step_once(tmp_path, rollouts):
    _stop(tmp_path, rollouts, "sigterm")
    resumed = Launch(tmp_path, rollouts, "resumed")
    assert resumed.wait() == 0, resumed.output()
    assert resumed.steps() == list(range(1, STEPS + 1))  # every step exactly once
    hist = read_wandb_history(tmp_path / "run" / "wandb")
    assert [int(r["_step"]) for r in hist] == list(range(1, STEPS + 1))
    assert not (tmp_path / "run" / SUPERSEDED).exists()  # nothing had to be superseded


@pytest.fixture(scope="module")
def straight(tmp_path_factory, rollouts) -> list[dict]:
    """The same run, never stopped: what a resumed run must reproduce."""
    tmp = tmp_path_factory.mktemp("straight")
    run = Launch(tmp, rollouts, "straight")
    assert run.wait() == 0, run.output()
    return read_jsonl_metrics(tmp / "run" / "metrics.jsonl")


def _same(rows: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in want]
    for got, row in zip(rows, want, strict=True):
        for k, v in row.items():
            if not k.startswith(NOT_COMPARED):
                assert got[k] == v, (row["step"], k)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "ctrl_c"])
def test_a_stop_through_the_launcher_resumes_exactly(how, tmp_path, rollouts, straight):
    _stop(tmp_path, rollouts, how, at=2)
    resumed = Launch(tmp_path, rollouts, "resumed")
    assert resumed.wait() == 0, resumed.output()
    _same(read_jsonl_metrics(tmp_path / "run" / "metrics.jsonl"), straight)
    hist = read_wandb_history(tmp_path / "run" / "wandb")
    assert [int(r["_step"]) for r in hist] == list(range(1, STEPS + 1))


def _gone(pids: dict[str, float]) -> list[int]:
    """Of ``pids`` (pid -> its create time), those still running, after waiting for them (bounded)."""
    deadline = time.monotonic() + 60
    while True:
        alive = []
        for pid, created in pids.items():
            try:
                p = psutil.Process(int(pid))
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(int(pid))
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.mark.slow
def test_a_sigkilled_rank_takes_its_children_along_and_the_resume_logs_each_step_once(
    tmp_path, rollouts, straight
):
    # Checkpoints at steps 2 and 4; rank 1 is killed during step 4, after rank 0 logged step 3.
    crashed = Launch(tmp_path, rollouts, "crashed", {"at_train_step": 4, "action": "sigkill", "rank": 1},
                     ["training.save_interval=2"])  # fmt: skip
    dead = crashed.at_fault()
    assert crashed.wait() != 0  # the job fails (fast), as it should
    assert dead["children"], "the rank had no child process to check (megatron's checkpoint writer)"
    assert _gone(dead["children"]) == [], f"children of the killed rank survived it: {dead['children']}"
    assert crashed.steps() == [1, 2, 3] and select_step_dir(tmp_path / "ck").step == 2
    resumed = Launch(tmp_path, rollouts, "resumed", extra=["training.save_interval=2"])
    assert resumed.wait() == 0, resumed.output()
    _same(read_jsonl_metrics(tmp_path / "run" / "metrics.jsonl"), straight)
    aside = read_jsonl_metrics(tmp_path / "run" / SUPERSEDED)
    assert [(r["step"], r["superseded_at_resume"]) for r in aside] == [(3, 2)]
    hist = read_wandb_history(tmp_path / "run" / "wandb")
    assert [int(r["_step"]) for r in hist] == list(range(1, STEPS + 1))
