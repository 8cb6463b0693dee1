"""Asynchronous RL end to end: real Megatron trainer, real SGLang CPU servers.

One runner process trains, in turn (start-up, not compute, dominates on CPU):

* ``k2``: async with K = 2 for 6 steps, preempted (SIGTERM) during its 4th, then resumed to 6 in the
  same run directory; every pushed weight set is recorded, and at the end the server scores every
  trained token again under the weights its version names (and under the next version);
* ``lag``: sync with ``rollout.weight_lag_steps: 1``;
* ``kill``: async with K = 1 on its own local server, killed after the 2nd step while the next
  batch is being generated.

The first two share one SGLang server started by the fixture (``rollout.server_urls``). The policy
starts untrained (no warm start: long, diverse completions) and an entropy bonus moves its weights
every step, so that versions really differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_e2e import run_spec

from megatron_acrl.batch.rollout_batch import load_rollouts
from megatron_acrl.config import load_config
from megatron_acrl.logging import read_jsonl_metrics
from megatron_acrl.warmstart.tiny_model import build_checkpoint
from sglang_bridge.server import ServerSpec, SGLangServer
from sglang_bridge.server_key import new_api_key

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "tiny_dense.yaml")
BASE = [
    "training.sft_steps=0",
    "task.num_digits=1",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "training.micro_batch_size=8",
    "rollout.max_new_tokens=40",
    "rollout.max_prompt_len=16",
    "rollout.quantization=none",
    "training.lr=1e-3",
    "algorithm.entropy_coef=0.1",
    "logging.wandb_mode=disabled",
]
K2_STEPS, LAG_STEPS, KILL_STEPS = 6, 3, 4
KEY_ENV = "ACRL_TEST_ASYNC_KEY"
"""Where the runs on the fixture's keyed server find its key (``rollout.api_key_env``)."""
GROUPS = 4  # prompts per step


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    cfg = load_config(CONFIG, BASE)
    ckpt = build_checkpoint(cfg.model, seed=cfg.training.seed)  # what the runs serve first
    key = new_api_key()
    server_spec = ServerSpec(model_path=str(ckpt), device="cpu", api_key=key)
    with SGLangServer(server_spec, tmp / "shared.log") as server:
        shared = [f"rollout.server_urls=[{server.url}]", f"rollout.api_key_env={KEY_ENV}"]
        k2 = [
            *BASE,
            *shared,
            "rollout.mode=async",
            "rollout.max_staleness=2",
            f"training.num_steps={K2_STEPS}",
        ]
        k2 += [f"training.checkpoint_dir={tmp / 'k2-ckpt'}"]
        k2_args = ["--run-dir", str(tmp / "k2"), "--save-rollouts", str(tmp / "k2-rollouts")]
        record = {"record_weights": str(tmp / "k2-weights")}
        score = {
            "rollouts": str(tmp / "k2-rollouts"),
            "weights": str(tmp / "k2-weights"),
            "out": str(tmp / "score.json"),
        }
        spec = [
            {
                "config": CONFIG,
                "overrides": k2,
                "args": k2_args,
                "hooks": {**record, "sigterm_at_train_step": 4},
            },
            {"config": CONFIG, "overrides": k2, "args": k2_args, "hooks": {**record, "score": score}},
            {
                "config": CONFIG,
                "overrides": [
                    *BASE,
                    *shared,
                    "rollout.weight_lag_steps=1",
                    f"training.num_steps={LAG_STEPS}",
                ],
                "args": ["--run-dir", str(tmp / "lag"), "--save-rollouts", str(tmp / "lag-rollouts")],
            },
            {
                "config": CONFIG,
                "overrides": [
                    *BASE,
                    "rollout.mode=async",
                    "rollout.max_staleness=1",
                    f"training.num_steps={KILL_STEPS}",
                ],
                "args": ["--run-dir", str(tmp / "kill"), "--save-rollouts", str(tmp / "kill-rollouts")],
                "hooks": {"kill_server_at_train_step": 2},
            },
        ]
        run_spec(tmp, spec, timeout=1800, runner="async_runner.py", env={KEY_ENV: key})
    return tmp


def batches(directory: Path, steps: int) -> list:
    return [load_rollouts(directory, s) for s in range(steps)]


def test_no_trained_token_is_older_than_k_and_partial_rollouts_happen(runs):
    seen_partial = False
    for step, b in enumerate(batches(runs / "k2-rollouts", K2_STEPS)):
        v = b.token_versions
        trained = (b.loss_mask > 0) & (v >= 0)
        assert bool(trained.any())
        lag = step - v[trained]
        assert int(lag.min()) >= 0 and int(lag.max()) <= 2, (step, lag.unique())
        per_sample = [set(r[r >= 0].tolist()) for r in v]
        seen_partial |= any(len(s) > 1 for s in per_sample)
    assert seen_partial, "no sample carried two weight versions: the updates never caught a request in flight"
    rows = read_jsonl_metrics(runs / "k2" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, K2_STEPS + 1))  # preempted and resumed: once each
    assert max(r["async/staleness_max"] for r in rows) <= 2
    for r in rows:
        fracs = [v for k, v in r.items() if k.startswith("async/lag_frac/")]
        assert abs(sum(fracs) - 1) < 1e-9
        assert "time/trainer_idle" in r and "time/server_idle" in r and "async/queue_depth" in r
    assert any("mismatch_lag1plus/k3_kl" in r for r in rows) and any("mismatch_lag0/k3_kl" in r for r in rows)


def test_segment_logprobs_are_the_ones_their_weights_give(runs):
    """Each segment's rollout log-probs match the server's scoring of the same tokens under the
    weights that segment's version names, and not under the next version's."""
    score = json.loads((runs / "score.json").read_text())
    versions = sorted({int(k.split("@")[0]) for k in score})
    assert len(versions) >= 3
    for v in versions:
        own = score[f"{v}@{v}"]
        assert own["n"] > 0 and own["max"] < 2e-2 and own["mean"] < 2e-3, (v, own)
        if f"{v}@{v + 1}" in score:
            assert score[f"{v}@{v + 1}"]["mean"] > 3 * own["mean"], (v, score)


def test_sigterm_resume_in_async_trains_every_group_once_and_loses_none(runs):
    state = json.loads((runs / "k2" / "state.json").read_text())
    trained = [g for b in batches(runs / "k2-rollouts", K2_STEPS) for g in set(b.group_ids.tolist())]
    assert len(trained) == len(set(trained)) == K2_STEPS * GROUPS  # no group trained twice
    pending = {g for g, *_ in state["producer"]["pending"]}
    assert not pending & set(trained)
    assert set(trained) | pending == set(range(state["producer"]["next_gid"]))  # none lost
    assert state["prompts_consumed"] == state["producer"]["next_gid"]


def test_weight_lag_serves_the_policy_of_l_steps_ago(runs):
    got = [set(b.weight_versions) for b in batches(runs / "lag-rollouts", LAG_STEPS)]
    assert got == [{"step-0"}, {"step-0"}, {"step-1"}]
    rows = read_jsonl_metrics(runs / "lag" / "metrics.jsonl")
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]


def test_killed_server_mid_async_is_restarted_and_nothing_is_lost(runs):
    rows = read_jsonl_metrics(runs / "kill" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, KILL_STEPS + 1))
    assert rows[-1]["rollout/server_restarts"] >= 1
    assert all(r["rollout/num_sequences"] == GROUPS * 4 for r in rows)
    trained = [g for b in batches(runs / "kill-rollouts", KILL_STEPS) for g in set(b.group_ids.tolist())]
    assert len(trained) == len(set(trained)) == KILL_STEPS * GROUPS
    state = json.loads((runs / "kill" / "state.json").read_text())
    assert max(r["async/staleness_max"] for r in rows) <= 1
    assert state["step"] == KILL_STEPS
