"""Async agent RL end to end: a real Megatron trainer, a real SGLang CPU server, multi-turn trajectories.

One runner process (``tests/agent/agent_async_runner.py``) trains the tiny dense model asynchronously
(K = 1) on three-turn trajectories (``tests.agent.async_agents:three_turns``: the untrained model
answers anything, the agent asks "Again." twice), for 5 steps: SIGTERMed during its 4th optimizer
step, then resumed to 5 in the same run directory. From each run's second step on, a step first
waits until some trajectory is between its turns (the runner's ``push_mid_trajectory``), so its push
lands in the middle of trajectories: they span two versions. Every pushed weight set is recorded;
at the end the server scores every trained trajectory again, teacher-forced, under the weights each
generated token's version names (and under the next version's). The entropy bonus moves the
weights every step, so versions really differ.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_e2e import run_spec

from megatron_acrl.batch.rollout_batch import load_rollouts
from megatron_acrl.config import load_config
from megatron_acrl.logging import read_jsonl_metrics
from megatron_acrl.warmstart.tiny_model import build_checkpoint
from sglang_bridge.server import ServerSpec, SGLangServer
from sglang_bridge.server_key import new_api_key

# One async agent run on a real server, stopped and resumed, read by every test here (~75 s quiet):
# the slow tier. tests/agent/test_agent_async.py proves the same bookkeeping on a stand-in backend.
pytestmark = [pytest.mark.timeout(2400), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny_dense.yaml")
STEPS, K, GROUPS, N = 5, 1, 4, 4
BASE = [
    "training.sft_steps=0",
    "task.num_digits=1",
    f"rollout.prompts_per_step={GROUPS}",
    f"rollout.n_samples_per_prompt={N}",
    "training.micro_batch_size=8",
    "rollout.max_new_tokens=12",
    "rollout.max_prompt_len=16",
    "rollout.quantization=none",
    "rollout.agent.agent=tests.agent.async_agents:three_turns",
    "rollout.agent.max_trajectory_tokens=120",
    "rollout.mode=async",
    f"rollout.max_staleness={K}",
    "training.lr=1e-3",
    "algorithm.entropy_coef=0.1",
    "logging.wandb_mode=disabled",
    f"training.num_steps={STEPS}",
]
KEY_ENV = "ACRL_TEST_AGENT_ASYNC_KEY"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("agent-async")
    cfg = load_config(CONFIG, BASE)
    ckpt = build_checkpoint(cfg.model, seed=cfg.training.seed)
    key = new_api_key()
    with SGLangServer(
        ServerSpec(model_path=str(ckpt), device="cpu", api_key=key), tmp / "sglang.log"
    ) as server:
        overrides = [
            *BASE,
            f"rollout.server_urls=[{server.url}]",
            f"rollout.api_key_env={KEY_ENV}",
            f"training.checkpoint_dir={tmp / 'ckpt'}",
        ]
        args = ["--run-dir", str(tmp / "run"), "--save-rollouts", str(tmp / "rollouts")]
        record = {"record_weights": str(tmp / "weights"), "push_mid_trajectory": 120}
        score = {
            "rollouts": str(tmp / "rollouts"),
            "weights": str(tmp / "weights"),
            "out": str(tmp / "score.json"),
        }
        spec = [
            {
                "config": CONFIG,
                "overrides": overrides,
                "args": args,
                "hooks": {**record, "sigterm_at_train_step": 4},
            },
            {
                "config": CONFIG,
                "overrides": overrides,
                "args": args,
                "hooks": {**record, "score_turns": score},
            },
        ]
        # the runner's agent is imported by path (tests.agent.async_agents): the repository root on the
        # path, as pytest has it in this process
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {KEY_ENV: key, "PYTHONPATH": path}
        run_spec(tmp, spec, timeout=2000, runner="agent/agent_async_runner.py", env=env)
    return tmp


def test_sigterm_mid_run_resumes_with_every_step_once_and_no_trajectory_lost(runs: Path) -> None:
    rows = read_jsonl_metrics(runs / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # preempted and resumed: once each
    assert all(r["agent/turns_mean"] == 3.0 and r["rollout/num_sequences"] == GROUPS * N for r in rows)
    state = json.loads((runs / "run" / "state.json").read_text())
    trained = [g for s in range(STEPS) for g in set(load_rollouts(runs / "rollouts", s).group_ids.tolist())]
    assert len(trained) == len(set(trained)) == STEPS * GROUPS  # no group trained twice
    pending = {g for g, *_ in state["producer"]["pending"]}
    assert not pending & set(trained)
    assert set(trained) | pending == set(range(state["producer"]["next_gid"]))  # none lost


def test_versions_per_generated_token_within_the_bound_and_trajectories_span_updates(runs: Path) -> None:
    for step in range(STEPS):
        b = load_rollouts(runs / "rollouts", step)
        gen = b.loss_mask > 0
        assert ((b.token_versions >= 0) == gen).all() and ((b.turn_ids >= 0) == gen).all()
        lag = step - b.token_versions[gen]
        assert int(lag.min()) >= 0 and int(lag.max()) <= K, (step, lag.unique())
    spans = json.loads((runs / "score.json").read_text())["spans"]
    print("trajectories spanning weight versions:", spans)
    assert spans["between_turns"] + spans["inside_turn"] >= N, spans  # updates in mid-trajectory


def test_each_segment_logprobs_are_the_ones_its_weights_give(runs: Path) -> None:
    """The generated tokens of each version, scored teacher-forced (the whole trajectory before
    them) under that version's weights, match their rollout log-probs within the single-turn path's
    tolerance (tests/test_async.py), and not under the next version's."""
    score = json.loads((runs / "score.json").read_text())
    versions = sorted({int(k.split("@")[0]) for k in score if "@" in k})
    assert len(versions) >= 2
    for v in versions:
        own = score[f"{v}@{v}"]
        print(f"version {v}: {own} vs next {score.get(f'{v}@{v + 1}')}")
        assert own["n"] > 0 and own["max"] < 2e-2 and own["mean"] < 2e-3, (v, own)
        if f"{v}@{v + 1}" in score:
            assert score[f"{v}@{v + 1}"]["mean"] > 3 * own["mean"], (v, score)
