"""MoE routing replay (R3) over the turns of agent trajectories, against a real SGLang CPU server.

The research recipe's tiny MoE (``configs/tiny_moe.yaml``, the init of ``tests/bridge/test_r3_server.py``:
many real bf16 routing flips) is served with ``--enable-return-routed-experts`` and its radix cache on.
Eight three-turn trajectories (``tests.agent.async_agents:three_turns``) run through
:class:`~megatron_acrl.rollout.agent.session.AgentSession`, every turn token-in-token-out. Turns
k >= 1 send the earlier turns' ids again: the server serves them from its radix cache (computing
nothing there) and reports the routing its cache slots hold. The session keeps each position's
routing from the turn that first computed it; the tests check

* the server's record of every turn equals the trajectory's on every position that turn covers
  (prefix positions included: they come from the earlier turn's record), and the prefixes of
  turns k >= 1 were cache hits;
* the trainer (Megatron, one gloo rank, fp32 on the served bf16 weights) with
  ``model.moe_routing_replay=rollout`` computes pi_old equal to SGLang's log-probs on every
  generated token of every turn, within the dense-model tolerance, and its routers used SGLang's
  experts everywhere; with replay off, routing flips push tokens of later turns past it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_launch import launch
from transformers import AutoTokenizer

from megatron_acrl.batch.rollout_batch import build_batch
from megatron_acrl.config import load_config
from megatron_acrl.rollout.agent.loop import run_trajectory
from megatron_acrl.rollout.agent.session import AgentSession, Trajectory
from megatron_acrl.rollout.trajectories import _TextTokenizer, agent_template
from megatron_acrl.tasks.base import Prompt
from megatron_acrl.warmstart.tiny_model import build_checkpoint
from sglang_bridge.client import SamplingParams, SGLangClient
from sglang_bridge.samples import Sample
from sglang_bridge.server import ServerSpec, SGLangServer
from tests.agent.async_agents import digit_answer, three_turns
from tests.fake_backend import CharTokenizer, FakeBackend

pytestmark = pytest.mark.timeout(2400)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_moe.yaml"
WORKER = ROOT / "tests" / "r3_worker.py"
DENSE_TOL = 1e-2  # trainer vs SGLang on the dense tiny model (tests/bridge/test_r3_server.py)
INIT = dict(  # tests/bridge/test_r3_server.py's init: small routers over a large shared component
    initializer_range=0.02,
    router_init_range=0.01,
    router_shared_init_range=0.4,
    expert_init_range=0.2,
    output_init_range=0.01,
)
TRAJECTORIES = 8


class Recorded:
    """The rollout backend the sessions send through: one SGLang client, every turn's sample kept
    by trajectory (its affinity key)."""

    def __init__(self, client: SGLangClient):
        self.client = client
        self.turns: dict[str, list[Sample]] = {}

    def generate_async(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *, affinity: str | None = None
    ) -> asyncio.Future[list[Sample]]:
        async def go() -> list[Sample]:
            out = await self.client.generate_batch(prompt_ids, [params] * len(prompt_ids))
            self.turns.setdefault(str(affinity), []).extend(out)
            return out

        return asyncio.ensure_future(go())


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = load_config(CONFIG).model
    return build_checkpoint(model, seed=0, **INIT, cache_dir=tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def rollout(moe_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Eight three-turn trajectories with their routing, each turn's server sample, and the batch
    (``step_000000.pt``) the trainer scores."""
    tmp = tmp_path_factory.mktemp("agent-r3")
    spec = ServerSpec(model_path=str(moe_ckpt), device="cpu", return_routed_experts=True)
    hf_tok = AutoTokenizer.from_pretrained(moe_ckpt)
    tok, template = _TextTokenizer(hf_tok), agent_template(hf_tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    prompts = [Prompt(text=f"{i}+{i + 1}=", answer=str(2 * i + 1), uid=i) for i in range(TRAJECTORIES)]

    async def go(url: str) -> tuple[list[Trajectory], Recorded]:
        async with SGLangClient(url, routed_experts_topk=2) as client:
            backend = Recorded(client)

            async def one(i: int) -> Trajectory:
                session = AgentSession(
                    backend, params, tok, template, max_turns=3, max_tokens=120, affinity=f"t{i}"
                )
                return await run_trajectory(three_turns, session, prompts[i])

            return list(await asyncio.gather(*(one(i) for i in range(TRAJECTORIES)))), backend

    with SGLangServer(spec, tmp / "sglang.log", startup_timeout_s=600, name="sglang-moe-agent") as srv:
        trajs, backend = asyncio.run(go(srv.url))
    batch = build_batch(
        [t.prompt_ids for t in trajs],
        [t.output_ids for t in trajs],
        [t.logprobs for t in trajs],
        rewards=[0.0] * len(trajs),
        group_ids=[i // 2 for i in range(len(trajs))],
        pad_id=int(hf_tok.pad_token_id or 0),
        routed_experts=[t.routed_experts for t in trajs],
        # no token_versions: this server never received weights (its version is "default")
        generated=[t.generated for t in trajs],
        turn_ids=[t.turn_ids for t in trajs],
    )
    path = tmp / "step_000000.pt"
    batch.save(path)
    turns = [backend.turns[f"t{i}"] for i in range(TRAJECTORIES)]
    return {"trajs": trajs, "turns": turns, "path": path, "batch": batch}


def test_every_turn_of_every_trajectory_was_served_and_kept_its_routing(rollout: dict[str, Any]) -> None:
    cfg = load_config(CONFIG).model
    for traj, turns in zip(rollout["trajs"], rollout["turns"], strict=True):
        assert traj.reason == "answered" and traj.turns == 3 and len(turns) == 3, traj.texts
        total = len(traj.prompt_ids) + len(traj.output_ids)
        r = traj.routed_experts
        assert r.shape == (total - 1, cfg.num_layers, cfg.moe_router_topk)
        for k, s in enumerate(turns):
            n = len(s.prompt_ids) + len(s.output_ids) - 1
            assert s.routed_experts.shape[0] == n
            # the server's record of turn k equals the trajectory's on every position it covers:
            # its prefix came from the radix cache, holding what the earlier turn computed
            assert np.array_equal(s.routed_experts, r[:n]), (k, int((s.routed_experts != r[:n]).sum()))
            if k >= 1:  # the prefix was a cache hit: at least the earlier turn's prompt and output
                prev = turns[k - 1]
                assert s.meta.get("cached_tokens", 0) >= len(prev.prompt_ids), (k, s.meta)
        assert traj.expert_prefix_recomputed == 0


@pytest.fixture(scope="module")
def scored(rollout: dict[str, Any], moe_ckpt: Path) -> dict[str, Any]:
    cases = [
        dict(name="off", layout={}, replay="off"),
        dict(name="rollout", layout={}, replay="rollout"),
    ]
    args = {"batch": str(rollout["path"]), "ckpt": str(moe_ckpt), "config": str(CONFIG), "cases": cases}
    return launch("sglang", 1, args, timeout=2000, worker=WORKER)[0]


def _gaps(rollout: dict[str, Any], res: dict[str, Any]) -> dict[int, torch.Tensor]:
    """|pi_old - mu| on the generated tokens of each turn."""
    b = rollout["batch"]
    gap = (res["old"] - b.rollout_logprobs).abs()
    gen = b.loss_mask > 0
    return {k: gap[gen & (b.turn_ids == k)] for k in range(3)}


def test_replay_matches_the_server_on_every_generated_token_of_every_turn(rollout, scored) -> None:
    gaps = _gaps(rollout, scored["rollout"])
    print(
        "R3 over turns, max |pi_old - mu| per turn:", {k: round(float(g.max()), 5) for k, g in gaps.items()}
    )
    for k, g in gaps.items():
        assert len(g) > 0 and float(g.max()) < DENSE_TOL, (k, float(g.max()))
    assert scored["rollout"]["routing"]["routing/disagree_frac_applied"] == 0.0  # SGLang's experts


def test_without_replay_routing_flips_move_later_turns_past_the_tolerance(rollout, scored) -> None:
    """The control: the same batch scored with the trainer's own routing disagrees with SGLang's,
    so the agreement above is the replay's doing, on the turns served from the cache too."""
    m = scored["off"]["routing"]
    gaps = _gaps(rollout, scored["off"])
    print("replay off, max |pi_old - mu| per turn:", {k: round(float(g.max()), 5) for k, g in gaps.items()})
    assert m["routing/disagree_frac"] > 0
    assert max(float(gaps[k].max()) for k in (1, 2)) > DENSE_TOL


class Routed(FakeBackend):
    """A fake that reports routing for every position it covers, marked with its request's index
    (``[..., 1]``): a recomputed prefix reports other experts than the turn that computed it."""

    def _make(self, prompt, out, versions, finish):  # noqa: ANN001, ANN202
        s = super()._make(prompt, out, versions, finish)
        n = len(prompt) + len(out) - 1
        r = np.zeros((n, 2, 2), np.int32)
        r[..., 0] = np.arange(n)[:, None]
        r[..., 1] = len(self.requests)
        s.routed_experts = r
        return s


def test_each_position_keeps_the_routing_of_the_turn_that_first_computed_it() -> None:
    """Fast, no server: turn k's answer covers the whole prefix, the session keeps the earlier
    turns' record there, takes the new positions from turn k, and counts the disagreeing prefix."""
    from megatron_acrl.rollout.agent.templates import TINY_CHATML

    fake = Routed(digit_answer, max_new_tokens=64)
    session = AgentSession(
        fake,
        fake.sampling_params(),
        _TextTokenizer(CharTokenizer()),
        TINY_CHATML,
        max_turns=3,
        max_tokens=2048,
        affinity="t",
    )
    traj = asyncio.run(run_trajectory(three_turns, session, Prompt(text="2+3=", answer="1", uid=0)))
    r = traj.routed_experts
    total = len(traj.prompt_ids) + len(traj.output_ids)
    assert r.shape == (total - 1, 2, 2) and (r[:, 0, 0] == np.arange(total - 1)).all()
    ends = []
    covered = 0
    for k, prompt in enumerate(fake.requests):
        n = len(prompt[0]) + sum(1 for t in traj.turn_ids if t == k) - 1  # this turn's positions
        assert (r[covered:n, :, 1] == k + 1).all()  # the turn that first computed them
        ends.append(n)
        covered = n
    assert covered == total - 1
    assert traj.expert_prefix_recomputed == ends[0] + ends[1]  # turns 1 and 2 reported their prefix anew
