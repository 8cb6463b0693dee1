"""Real faults mid-rollout (issue #36 item 2), real Megatron trainer, real SGLang CPU servers, W&B
offline (``tests/rollout_fault_runner.py``):

* the lone server (the default: one server, no router) SIGSTOPped while step 2's rollout is in
  flight: its requests time out, rank 0 finds it stopped, kills its process tree, starts a fresh
  one, re-sends the served weights and retries the step with the same prompts;
* the sglang-router in front of the lone server SIGKILLed while step 2's rollout is in flight: it
  is started again on its port with the same worker and the step retried;
* the lone server behind sglang-router SIGSTOPped the same way (the router's HTTP error, or the
  request's timeout, with no process dead): replaced as without the router, and routed to again;
* the lone server SIGSTOPped while the async trainer waits for a batch: the engine's requests
  fail, rank 0 replaces the server, and the engine resubmits exactly the lost samples.

Each run finishes, every RL step appears exactly once in ``metrics.jsonl`` and in the W&B offline
history, and the replacement is in the metrics (``rollout/hung_restarts``,
``rollout/router_restarts``) and in the log. The four runs share one runner process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_e2e import CONFIG, rows, run_spec

from megatron_acrl.logging import read_wandb_history

STEPS = 3
GROUPS, SAMPLES = 4, 4
BASE = [
    "task.num_digits=1",
    f"rollout.prompts_per_step={GROUPS}",
    f"rollout.n_samples_per_prompt={SAMPLES}",
    "rollout.max_new_tokens=6",
    "rollout.max_prompt_len=16",
    "training.micro_batch_size=8",
    f"training.num_steps={STEPS}",
    # A hung server is found once its requests have waited this long with nothing finished.
    "rollout.request_timeout_s=45",
    "logging.wandb_mode=offline",
]
RUNS = {
    "hung": ([], {"sigstop_server_after_publish": 1}),
    "router": (["rollout.router=sglang"], {"kill_router_after_publish": 1}),
    "router_hung": (["rollout.router=sglang"], {"sigstop_server_after_publish": 1}),
    "async": (["rollout.mode=async", "rollout.max_staleness=1"], {"sigstop_server_while_waiting": 0}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("rollout-faults")
    spec = [
        {"config": CONFIG, "overrides": BASE + extra, "args": ["--run-dir", str(tmp / name)], "hooks": hooks}
        for name, (extra, hooks) in RUNS.items()
    ]
    res = run_spec(tmp, spec, timeout=3000, runner="rollout_fault_runner.py")
    return tmp, res.stdout + res.stderr


def _every_step_once(run_dir: Path) -> list[dict]:
    r = rows(run_dir)
    assert [x["step"] for x in r] == list(range(1, STEPS + 1))  # every step, exactly once
    hist = read_wandb_history(run_dir / "wandb")
    assert [int(h["_step"]) for h in hist] == list(range(1, STEPS + 1))  # and so in W&B
    assert all(x["rollout/num_sequences"] == GROUPS * SAMPLES for x in r)
    state = json.loads((run_dir / "state.json").read_text())
    assert state["step"] == STEPS
    return r


@pytest.mark.slow
def test_a_lone_server_hung_mid_rollout_is_replaced_and_every_step_runs_once(runs: tuple[Path, str]) -> None:
    tmp, log = runs
    r = _every_step_once(tmp / "hung")
    assert "is hung during a rollout: processes" in log  # the log says what happened
    assert [x["rollout/hung_restarts"] for x in r] == [0.0, 1.0, 1.0]  # step 2's rollout replaced it
    assert r[1]["rollout/server_restarts"] == 1.0 and r[-1]["sync/hung_restarts"] == 1.0
    state = json.loads((tmp / "hung" / "state.json").read_text())
    assert state["prompts_consumed"] == GROUPS * STEPS  # the failed try's prompts were given back
    fault = json.loads((tmp / "hung" / "fault.json").read_text())
    assert fault["error"] is None and len(fault["signalled_pids"]) >= 2  # server + scheduler, ...
    assert fault["still_running"] == [] and fault["replaced"]  # the whole tree killed, a fresh one


@pytest.mark.slow
def test_a_router_killed_mid_rollout_is_restarted_on_its_port_and_every_step_runs_once(
    runs: tuple[Path, str],
) -> None:
    tmp, log = runs
    r = _every_step_once(tmp / "router")
    assert "sglang-router exited; restarted on" in log
    assert [x["rollout/router_restarts"] for x in r] == [0.0, 1.0, 1.0]
    assert all(x["rollout/hung_restarts"] == 0.0 for x in r)  # the server was kept
    fault = json.loads((tmp / "router" / "fault.json").read_text())
    assert fault["error"] is None and fault["still_running"] == []
    assert fault["router_alive"] and fault["router_port_after"] == fault["router_port_before"]
    assert fault["routed"] == fault["urls"]  # the same worker


@pytest.mark.slow
def test_a_lone_server_hung_behind_the_router_is_replaced_and_routed_to(runs: tuple[Path, str]) -> None:
    tmp, _ = runs
    r = _every_step_once(tmp / "router_hung")
    assert [x["rollout/hung_restarts"] for x in r] == [0.0, 1.0, 1.0]
    assert all(x["rollout/router_restarts"] == 0.0 for x in r)  # the router was kept
    fault = json.loads((tmp / "router_hung" / "fault.json").read_text())
    assert fault["error"] is None and fault["still_running"] == [] and fault["replaced"]
    assert fault["router_alive"] and fault["routed"] == fault["urls"]  # the fresh server is routed to


@pytest.mark.slow
def test_async_a_lone_server_hung_while_the_trainer_waits_is_replaced(runs: tuple[Path, str]) -> None:
    tmp, log = runs
    r = _every_step_once(tmp / "async")
    assert r[-1]["rollout/hung_restarts"] == 1.0 and r[-1]["sync/hung_restarts"] == 1.0
    assert "is hung during a rollout" in log
    fault = json.loads((tmp / "async" / "fault.json").read_text())
    assert fault["error"] is None and fault["still_running"] == [] and fault["replaced"]
