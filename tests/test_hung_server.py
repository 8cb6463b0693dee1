"""A rollout server that hangs in the middle of a weight sync (issue #25): its whole process group
stopped with SIGSTOP as the sync posts its first bucket, past ``rollout.weight_sync_timeout_s``.
The driver kills the hung server's process tree, starts a fresh one, connects a new synchronizer
and retries the sync: the run finishes every step exactly once, exit 0, and the fresh server holds
the trainer's weights. Real Megatron trainer, real SGLang CPU server (``tests/hung_runner.py``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_e2e import CONFIG, rows, run_spec

STEPS = 3
OVERRIDES = [
    "task.num_digits=1",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=6",
    "rollout.max_prompt_len=16",
    "rollout.quantization=none",  # served bf16: verify compares the trainer's weights as they are
    "rollout.weight_sync_timeout_s=5",
    "training.micro_batch_size=8",
    f"training.num_steps={STEPS}",
    # An entropy bonus and a large step: the weights move every step whatever the rewards, so a
    # server left on older weights would show in verify.
    "algorithm.entropy_coef=0.01",
    "training.lr=1e-2",
    "logging.wandb_mode=disabled",
]


def _run(tmp: Path, spec: list[dict]) -> subprocess.CompletedProcess[str]:
    return run_spec(tmp, spec, timeout=1200, runner="hung_runner.py")


@pytest.mark.slow
def test_a_server_hung_mid_sync_is_killed_replaced_and_every_step_runs_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "hung"
    spec = [
        {
            "config": CONFIG,
            "overrides": OVERRIDES,
            "args": ["--run-dir", str(run_dir)],
            "hooks": {"sigstop_at_sync": "step-1"},
        }
    ]
    res = _run(tmp_path, spec)
    assert "is hung during a weight sync" in res.stdout + res.stderr  # the log says what happened
    r = rows(run_dir)
    assert [x["step"] for x in r] == list(range(1, STEPS + 1))  # every step, exactly once
    assert [x["sync/hung_restarts"] for x in r] == [1.0] * STEPS  # the sync after step 1 recovered
    assert r[0]["sync/restarts"] == 1.0
    assert all(x["rollout/num_sequences"] == 16 for x in r)
    hung = json.loads((run_dir / "hung.json").read_text())
    assert len(hung["stopped_pids"]) >= 2  # the server and its scheduler / detokenizer
    assert hung["still_running"] == []  # the whole tree is gone (SIGKILL reaches stopped processes)
    assert hung["replaced"] and not hung["in_registry"]  # and the bridge's registry forgot it
    assert hung["versions"] == [f"step-{STEPS}"]  # the fresh server took every sync since
    assert hung["delta_trainer"] < 1e-2, hung  # it serves the trainer's weights ...
    assert hung["delta_initial"] > 0.1, hung  # ... not the checkpoint it was started from
    state = json.loads((run_dir / "state.json").read_text())
    assert state["step"] == STEPS and state["prompts_consumed"] == 4 * STEPS
