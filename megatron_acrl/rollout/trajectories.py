"""Agentic rollouts in the sync rollout phase: n trajectories per prompt, packed into a RolloutBatch.

:func:`megatron_acrl.rollout.phase.sample_groups` calls :func:`sample_trajectories` when
``rollout.agent.agent`` or ``rollout.agent.env`` is set. Every trajectory runs concurrently in one
event loop (:func:`~megatron_acrl.rollout.agent.loop.run_trajectory`, its turns pinned to one server
by its id); a group is a prompt's ``n_samples_per_prompt`` trajectories, as in single-turn GRPO, and
its reward is the trajectory's (the env's sum of turn rewards, or what the agent returned).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from megatron_acrl.batch.rollout_batch import RolloutBatch, build_batch
from megatron_acrl.batch.staleness import token_versions
from megatron_acrl.config import resolve_import_path
from megatron_acrl.rollout.agent.envs import make_env
from megatron_acrl.rollout.agent.loop import AgentFn, env_agent, load_agent, run_trajectory
from megatron_acrl.rollout.agent.openai_server import close_endpoints
from megatron_acrl.rollout.agent.session import AgentSession, Trajectory
from megatron_acrl.rollout.agent.templates import QWEN_STYLE, TINY_CHATML, ChatTemplate
from megatron_acrl.tasks.base import Prompt

if TYPE_CHECKING:
    from megatron_acrl.run.context import RunContext

_TRAJECTORY_IDS = itertools.count()


class _TextTokenizer:
    """The run's tokenizer as the session needs it: no special tokens added, special tokens decoded."""

    def __init__(self, tok: Any):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens))


def agent_template(tokenizer: Any) -> ChatTemplate:
    """The template the trajectories are rendered with: Qwen-style for a tokenizer whose own template
    uses ``<tool_response>``, else the tiny ChatML one."""
    own = str(getattr(tokenizer, "chat_template", "") or "")
    return QWEN_STYLE if "<tool_response>" in own else TINY_CHATML


def trajectory_versions(traj: Trajectory) -> list[int]:
    """``[O]`` the weight version of each generated id (its turn's segments), -1 on the others."""
    out = [-1] * len(traj.output_ids)
    for offset, n, final, segments in traj.version_spans:
        out[offset : offset + n] = token_versions(n, final, segments)
    return out


def _agent(ctx: RunContext) -> AgentFn:
    a = ctx.cfg.rollout.agent
    return load_agent(resolve_import_path(a.agent)) if a.agent is not None else env_agent


class AgentRunner:
    """What every trajectory of a run shares: the agent, the tokenizer and template, the sampling.
    The sync phase makes one per step; the async engine one per run."""

    def __init__(self, ctx: RunContext):
        assert ctx.servers is not None
        self.ctx = ctx
        self.agent = _agent(ctx)
        self.tok = _TextTokenizer(ctx.tokenizer)
        self.template = agent_template(ctx.tokenizer)
        self.params = ctx.servers.sampling_params()

    def session(self, affinity: str, *, backend: Any = None, abort_retries: int = 0) -> AgentSession:
        """A fresh session (and env) for one trajectory, its turns pinned by ``affinity``, sent
        through ``backend`` (default: the run's servers)."""
        a = self.ctx.cfg.rollout.agent
        env = make_env(a, self.ctx.task) if a.env is not None else None
        return AgentSession(
            backend if backend is not None else self.ctx.servers,
            self.params,
            self.tok,
            self.template,
            max_turns=a.max_turns,
            max_tokens=a.max_trajectory_tokens,
            affinity=affinity,
            env=env,
            abort_retries=abort_retries,
        )

    async def run(self, session: AgentSession, sample: Prompt) -> Trajectory:
        """The agent's trajectory of ``sample`` in ``session`` (:func:`run_trajectory`)."""
        traj = await run_trajectory(self.agent, session, sample)
        if not traj.prompt_ids:  # the agent failed before its first turn: an empty, untrained row
            traj.prompt_ids = self.tok.encode(sample.text) or [self.ctx.pad_id]
        return traj


async def _run_all(
    ctx: RunContext, prompts: Sequence[Prompt], n: int, params: Any = None
) -> list[Trajectory]:
    runner = AgentRunner(ctx)
    if params is not None:  # an evaluation's (greedy) sampling
        runner.params = params
    assert ctx.servers is not None

    async def one(sample: Prompt) -> Trajectory:
        return await runner.run(runner.session(f"traj-{next(_TRAJECTORY_IDS)}"), sample)

    try:
        return list(await asyncio.gather(*(one(p) for p in prompts for _ in range(n))))
    finally:  # this event loop's clients and OpenAI endpoint: asyncio.run closes the loop next
        await close_endpoints()
        await ctx.servers.aclose()


def sample_trajectories(
    ctx: RunContext, prompts: list[Prompt], first_group: int, *, n: int | None = None, params: Any = None
) -> RolloutBatch:
    """Rank 0: ``n`` (default ``rollout.n_samples_per_prompt``) agent trajectories of each prompt
    (the envs state their tools in their own instructions, so no ``tools`` block is rendered), as a
    batch whose ``loss_mask`` covers the generated ids only
    (:func:`~megatron_acrl.batch.rollout_batch.build_batch`). ``params``: the sampling of every turn
    (default the rollout's; the evaluation passes greedy ones)."""
    n = ctx.cfg.rollout.n_samples_per_prompt if n is None else n
    trajs = asyncio.run(_run_all(ctx, prompts, n, params))
    return trajectories_batch(
        ctx,
        trajs,
        [p.text for p in prompts for _ in range(n)],
        [first_group + i // n for i in range(len(trajs))],
    )


def trajectories_batch(
    ctx: RunContext, trajs: Sequence[Trajectory], prompts: Sequence[str], group_ids: Sequence[int]
) -> RolloutBatch:
    """Finished trajectories as batch rows (row i: ``prompts[i]``'s, group ``group_ids[i]``), with
    per-token versions and turns, the routing (R3) and the per-row agent counts."""
    experts = [t.routed_experts for t in trajs]
    with_experts = [e is not None for e in experts]
    if any(with_experts) and not all(with_experts):
        raise ValueError("some trajectories carry routed_experts and others do not (mixed servers?)")
    batch = build_batch(
        [t.prompt_ids for t in trajs],
        [t.output_ids for t in trajs],
        [t.logprobs for t in trajs],
        rewards=[t.reward for t in trajs],
        group_ids=list(group_ids),
        pad_id=ctx.pad_id,
        finish_reasons=[t.reason for t in trajs],
        weight_versions=[t.weight_version for t in trajs],
        prompts=list(prompts),
        completions=[" | ".join(t.texts) for t in trajs],
        routed_experts=experts if any(with_experts) else None,
        token_versions=[trajectory_versions(t) for t in trajs],
        generated=[t.generated for t in trajs],
        turn_ids=[t.turn_ids for t in trajs],
    )
    batch.agent_rows = [trajectory_row(t) for t in trajs]
    return batch


def trajectory_row(t: Trajectory) -> dict[str, float]:
    """One trajectory's counts, kept per batch row (they follow DAPO's selection)."""
    row = {
        "turns": float(t.turns),
        "tool_calls": float(t.tool_calls),
        "tool_errors": float(t.tool_errors),
        "env_s": t.env_s,
        "truncated": float(t.truncated),
        "aborted_turns": float(t.aborted_turns),
        "expert_prefix_recomputed": float(t.expert_prefix_recomputed),
    }
    for role in ("generated", "observation", "boundary"):
        row[f"tokens_{role}"] = float(t.kinds.count(role))
    return row


def agent_metrics(batch: RolloutBatch) -> dict[str, float]:
    """``agent/*``: turns per trajectory, tool calls and errors, env seconds, the truncated
    fraction, aborted turns, recomputed routing prefixes, tokens by role (summed over the batch)
    and the count of each end reason."""
    rows = batch.agent_rows
    if not rows:
        return {}
    k = len(rows)
    total = {key: sum(r[key] for r in rows) for key in rows[0]}
    out = {
        "agent/turns_mean": total["turns"] / k,
        "agent/tool_calls": total["tool_calls"],
        "agent/tool_errors": total["tool_errors"],
        "agent/env_s": total["env_s"],
        "agent/truncated_frac": total["truncated"] / k,
        # async: turns aborted by a weight update and sent again; MoE: prefix positions whose routing
        # a later turn reported differently (recomputed after a cache flush; the first record is kept)
        "agent/aborted_turns": total["aborted_turns"],
        "agent/r3_prefix_recomputed": total["expert_prefix_recomputed"],
    }
    for role in ("generated", "observation", "boundary"):
        out[f"agent/tokens_{role}"] = total[f"tokens_{role}"]
    for reason in sorted(set(batch.finish_reasons)):
        out[f"agent/end_{reason}"] = float(batch.finish_reasons.count(reason))
    return out
