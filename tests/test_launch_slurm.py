"""Launch tests against a REAL local SLURM cluster (slurm-wlm 22.05 on loopback, see
``launch/slurm_local.py``): bad input is refused before anything is queued; jobs submitted through
``python -m launch.submit`` complete, fail with the reason in the log, and survive preemption.

The trainer here is ``tests/launch_standin_trainer.py`` (same CLI and exit-code contract as
``python -m megatron_acrl.train``, no model, so each job takes seconds); the real driver plugs in
through ``--entry-module`` (its default). Rollout servers are ``tests/launch_standin_server.py``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
from launch_helpers import job_id_of, job_info, queued_jobs, submit, wait_job
from launch_helpers import slurm as slurm  # noqa: F401 - session fixture

from megatron_acrl.warmstart.tiny_model import build_tokenizer

pytestmark = pytest.mark.usefixtures("slurm")

TINY = "configs/tiny_dense.yaml"
STANDIN = ["--entry-module", "tests.launch_standin_trainer"]
TOKENIZER = str(build_tokenizer(320))
"""A stand-in ``model.hf_path``: submit loads its tokenizer as the trainer would (no config.json)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log(run: Path, job: str) -> str:
    return (run / "logs" / f"job-{job}.out").read_text()


# ---- bad input: refused at submit time, nothing queued ---------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus-per-node", "4", f"model.hf_path={TOKENIZER}"], "have at most 2 GPUs"),
        (["--nodes", "3", f"model.hf_path={TOKENIZER}"], "has only 1 node(s)"),
        (["--partition", "nope"], "unknown partition 'nope'; this cluster has: debug"),
        (["task.name=gsm8k", "task.data_path=/nonexistent/train.jsonl"], "task.data_path: no such file"),
        (["model.hf_path=/nonexistent/ckpt"], "model.hf_path: no such file"),
        (["--ranks-per-node", "3"], "each node needs 3 CPUs"),
        (
            ["--ranks-per-node", "2", "parallel.world_size=4"],
            "config asks for 4 trainer ranks but the job has 2",
        ),
        (["--ranks-per-node", "1", "parallel.dp=2"], "set parallel.dp=1"),
        (["training.num_stepz=3"], "did you mean 'training.num_steps'"),
    ],
)
def test_bad_input_fails_before_queueing(tmp_path, args, message):
    before = queued_jobs()
    proc = submit([TINY, "--output-dir", str(tmp_path), *STANDIN, *args])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "nothing was submitted" in proc.stderr
    assert queued_jobs() == before
    assert not (tmp_path / "tiny_dense" / "job.sbatch").exists()


# ---- jobs that run -----------------------------------------------------------------------------------


def test_two_rank_job_completes(tmp_path):
    proc = submit(
        [TINY, "--output-dir", str(tmp_path), *STANDIN, "--ranks-per-node", "2", "training.num_steps=4"]
    )
    job = job_id_of(proc)
    info = wait_job(job)
    run = tmp_path / "tiny_dense"
    log = _log(run, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    done = json.loads((run / "standin-done.json").read_text())
    assert done == {"final_step": 4, "world": 2, "master": "localhost", "restart": 0}
    assert "0: rank 0/2 master=localhost" in log and "1: rank 1/2 master=localhost" in log
    assert (run / "status").read_text().startswith("COMPLETED")
    # The job ran the frozen config with its checkpoints under the run directory.
    assert f"checkpoint_dir: {run / 'checkpoints'}" in (run / "submitted-config.yaml").read_text()


def test_torchrun_with_servers_started_by_the_job(tmp_path):
    """Single node, CPU, --servers-in-job: the script starts the server step, waits for it, and passes
    rollout.server_urls to a torchrun-launched trainer."""
    port = _free_port()
    proc = submit(
        [TINY, "--output-dir", str(tmp_path), *STANDIN, "--server-module", "tests.launch_standin_server",
         "--servers-in-job", "--launcher", "torchrun", "--ranks-per-node", "1",
         f"rollout.base_port={port}", f"model.hf_path={TOKENIZER}", "training.num_steps=2"]
    )  # fmt: skip
    job = job_id_of(proc)
    info = wait_job(job)
    log = _log(tmp_path / "tiny_dense", job)
    assert info["JobState"] == "COMPLETED", log
    assert f"servers ok: ['http://127.0.0.1:{port}'] key=yes" in log  # keyed on loopback too
    assert "all 1 rollout server(s) healthy" in log


def test_failing_rank_fails_the_job_with_the_reason(tmp_path):
    proc = submit(
        [TINY, "--output-dir", str(tmp_path), *STANDIN, "--ranks-per-node", "2", "training.num_steps=50"],
        env={"STANDIN_FAIL_RANK": "1", "STANDIN_FAIL_STEP": "2"},
    )
    job = job_id_of(proc)
    info = wait_job(job)
    run = tmp_path / "tiny_dense"
    log = _log(run, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "3:0", log
    assert "1: rank 1: injected failure at step 2" in log
    assert "rank 1: exit code 3" in log and "trainer step failed, first rank 1 with exit code 3" in log
    assert (run / "status").read_text().startswith("FAILED rc=3")
    assert not (run / "standin-done.json").exists()


@pytest.mark.parametrize(
    ("mode", "why"), [("crash", "exited before becoming healthy"), ("hang", "did not come up within 3 s")]
)
def test_server_that_does_not_come_up_is_named(tmp_path, mode, why):
    port = _free_port()
    proc = submit(
        [TINY, "--output-dir", str(tmp_path), *STANDIN, "--server-module", "tests.launch_standin_server",
         "--servers-in-job", "--server-timeout", "3", "--ranks-per-node", "1",
         f"rollout.base_port={port}", f"model.hf_path={TOKENIZER}"],
        env={"STANDIN_SERVER_MODE": mode},
    )  # fmt: skip
    job = job_id_of(proc)
    info = wait_job(job)
    log = _log(tmp_path / "tiny_dense", job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "69:0", log
    assert f"server 0 at http://127.0.0.1:{port}" in log and why in log
    assert "the trainer was not started" in log and "rank 0/" not in log


# ---- preemption: checkpoint, requeue, resume ------------------------------------------------------------


def _progress(run: Path) -> list[dict]:
    path = run / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_progress(run: Path, job: str, step: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p["step"] >= step for p in _progress(run)):
            return
        assert job_info(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), _log(run, job)
        time.sleep(0.2)
    raise AssertionError(f"job {job} never reached step {step}")


@pytest.mark.parametrize(
    "preempt",
    [
        # What `#SBATCH --signal=B:TERM@N` does at the time limit: SIGTERM to the batch script only.
        ["scancel", "--batch", "--signal=TERM"],
        # Preemption / an operator: SLURM terminates every step and requeues the job itself.
        ["scontrol", "requeue"],
    ],
    ids=["batch-sigterm", "scontrol-requeue"],
)
def test_preemption_checkpoints_requeues_and_resumes(tmp_path, preempt):
    proc = submit(
        [TINY, "--output-dir", str(tmp_path), *STANDIN, "--ranks-per-node", "2", "training.num_steps=6"],
        env={"STANDIN_HOLD_AT_STEP": "3"},  # the first run waits at step 3 for the signal
    )
    job = job_id_of(proc)
    run = tmp_path / "tiny_dense"
    _wait_progress(run, job, 3)
    subprocess.run([*preempt, job], check=True, timeout=30)
    info = wait_job(job)
    log = _log(run, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert "checkpoint at step 3 after SIGTERM" in log and "resumed from step 3" in log
    # Steps 1-3 ran before the preemption, 4-6 after it, none twice.
    assert [(p["step"], p["restart"]) for p in _progress(run)] == [
        (1, 0),
        (2, 0),
        (3, 0),
        (4, 1),
        (5, 1),
        (6, 1),
    ]
    assert json.loads((run / "standin-done.json").read_text())["final_step"] == 6
    assert (run / "status").read_text().startswith("COMPLETED restart=1")


# ---- the real product through SLURM ------------------------------------------------------------------


def test_real_driver_job_completes_with_wandb_metrics(tmp_path):
    """The tiny config through the launch CLI: real Megatron trainer (2 gloo ranks), a real SGLang CPU
    server started by the driver, ACRL, W&B offline; the job ends COMPLETED and its run holds the
    mismatch metrics."""
    from megatron_acrl.logging import read_wandb_history

    proc = submit(
        [
            TINY,
            "--output-dir",
            str(tmp_path),
            "--ranks-per-node",
            "2",
            "--job-name",
            "real",
            "training.num_steps=2",
            "training.sft_steps=0",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "training.micro_batch_size=8",
            "rollout.max_new_tokens=6",
            "parallel.tp=2",
        ]
    )
    job = job_id_of(proc)
    info = wait_job(job, timeout_s=900)
    run = tmp_path / "real"
    log = _log(run, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-5000:]
    hist = read_wandb_history(next(run.rglob("run-*.wandb")))
    assert [int(r["_step"]) for r in hist] == [1, 2]
    for key in ("reward/mean", "mismatch/k3_kl", "mismatch/chi2_token", "acrl/y_over_x", "sync/seconds"):
        assert key in hist[-1], key


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_real_driver_preempted_checkpoints_its_step_and_resumes_each_step_once(tmp_path, launcher):
    """The real driver (2 Megatron ranks, real checkpoints, W&B offline; recorded rollouts, no server)
    under both launchers, SIGTERM to the job at step 3 (the time-limit signal): the ranks checkpoint
    step 3 (megatron's checkpoint-writer helper, signalled with the step, survives: P12), the job
    requeues and the resumed run logs steps 4-5: every step once in metrics.jsonl, never twice in W&B."""
    from stop_runner import record_rollouts

    from megatron_acrl.logging import read_jsonl_metrics, read_wandb_history

    marker = tmp_path / "at-step-3.json"
    env = {
        "STOP_TEST_ROLLOUTS": str(record_rollouts(tmp_path / "rollouts", 5)),
        "STOP_TEST_FAULTS": json.dumps({"at_train_step": 3, "action": "pause", "marker": str(marker)}),
    }
    proc = submit(
        [TINY, "--output-dir", str(tmp_path), "--entry-module", "tests.launch_stop_trainer",
         "--ranks-per-node", "2", "--launcher", launcher, "training.num_steps=5",
         "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4", "training.micro_batch_size=4",
         "rollout.max_prompt_len=16", "task.num_digits=1", "logging.console=false"],
        env=env,
    )  # fmt: skip
    job = job_id_of(proc)
    run = tmp_path / "tiny_dense"
    deadline = time.monotonic() + 600  # a bound, so that a broken job fails here instead of hanging
    while not marker.exists():
        assert job_info(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), _log(run, job)
        assert time.monotonic() < deadline, f"job {job} never reached step 3"
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True, timeout=30)
    info = wait_job(job, timeout_s=900)
    log = _log(run, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-6000:]
    assert "checkpoint: step 3" in log and "resumed from step_00000003" in log, log[-6000:]
    assert "BrokenPipe" not in log
    assert [r["step"] for r in read_jsonl_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    # W&B: SLURM's SIGTERM reaches W&B's service process too (wandb-core dies of it): the first
    # attempt loses what it had not written, the run goes on, and the resumed attempt logs the lost
    # rows again from metrics.jsonl (docs/trainer.md): every step once, with the same values.
    hist = read_wandb_history(run / "wandb")
    assert [int(r["_step"]) for r in hist] == [1, 2, 3, 4, 5], [r["_step"] for r in hist]
    for h, r in zip(hist, read_jsonl_metrics(run / "metrics.jsonl"), strict=True):
        same = [k for k, v in r.items() if k != "step" and isinstance(v, float) and k in h]
        assert same and all(h[k] == r[k] for k in same), (r["step"], [k for k in same if h[k] != r[k]])
