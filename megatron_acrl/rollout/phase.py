"""The driver's rollout phase: prompts -> n samples each from the servers -> rewards -> a batch.

Rank 0 draws prompts, generates through :class:`megatron_acrl.servers.handle.RolloutServers`,
scores and packs them into a :class:`megatron_acrl.batch.rollout_batch.RolloutBatch` (or replays a
recorded one, ``--load-rollouts``), and :func:`collect_rollouts` broadcasts it to every rank. DAPO
dynamic sampling drops groups whose rewards are all equal and refills them with fresh prompts. A server
that dies or hangs mid-rollout, or a router that dies, is restarted (a hung server killed first) and
the step retried with the same prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from megatron_acrl.algo.advantages import dynamic_sampling_keep, overlong_penalty
from megatron_acrl.batch.rollout_batch import RolloutBatch, build_batch, load_rollouts, save_rollouts
from megatron_acrl.batch.staleness import token_versions
from megatron_acrl.rollout.trajectories import agent_metrics, sample_trajectories
from megatron_acrl.run.context import prompt_stream
from megatron_acrl.tasks.base import Prompt, Task
from megatron_acrl.world.distributed import log0
from megatron_acrl.world.vote import ERROR, NO_VERDICT, OK, RETRY, STOPPED, Verdict, vote

if TYPE_CHECKING:
    from megatron_acrl.rollout.backend import RolloutBackend
    from megatron_acrl.run.context import RunContext
    from megatron_acrl.run.resume import DriverState

ATTEMPTS = 3
"""Rollouts of one step tried at most this often (a dead server is restarted in between)."""


def encode_prompts(tokenizer: Any, prompts: Sequence[Prompt], max_prompt_len: int) -> list[list[int]]:
    """Token ids of each prompt; a prompt longer than ``max_prompt_len`` is an error, never truncated."""
    out = []
    for p in prompts:
        ids = tokenizer.encode(p.text, add_special_tokens=False)
        if len(ids) > max_prompt_len:
            raise ValueError(
                f"prompt {p.uid} has {len(ids)} tokens > rollout.max_prompt_len={max_prompt_len}; "
                "raise rollout.max_prompt_len or shorten the data"
            )
        out.append(ids)
    return out


def score_groups(
    task: Task,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[Sequence[int]],
    groups: Sequence[Sequence[Any]],
    *,
    pad_id: int,
    eos_id: int | None,
    first_group_id: int = 0,
    with_versions: bool = False,
) -> RolloutBatch:
    """Decode, reward and pack the samples of each prompt into a :class:`RolloutBatch`.

    ``groups[i]`` holds prompt i's samples (:class:`sglang_bridge.client.Sample`); they become the
    batch's consecutive rows with group id ``first_group_id + i``. ``with_versions``: also the
    per-token weight versions (training batches; an evaluation's pushes are outside the run's
    version sequence).
    """
    columns: dict[str, list[Any]] = {
        k: []
        for k in (
            "prompt_ids",
            "output_ids",
            "rollout_logprobs",
            "rewards",
            "group_ids",
            "finish_reasons",
            "weight_versions",
            "prompts",
            "completions",
        )
    }
    experts, versions = [], []
    for gi, (prompt, pids, samples) in enumerate(zip(prompts, prompt_ids, groups, strict=True)):
        for s in samples:
            out = list(s.output_ids)
            text_ids = out[:-1] if out and eos_id is not None and out[-1] == eos_id else out
            completion = tokenizer.decode(text_ids, skip_special_tokens=True)
            columns["prompt_ids"].append(list(pids))
            columns["output_ids"].append(out)
            columns["rollout_logprobs"].append(list(s.rollout_logprobs))
            columns["rewards"].append(task.reward(prompt, completion))
            columns["group_ids"].append(first_group_id + gi)
            columns["finish_reasons"].append(s.finish_reason)
            columns["weight_versions"].append(str(s.weight_version))
            columns["prompts"].append(prompt.text)
            columns["completions"].append(completion)
            experts.append(getattr(s, "routed_experts", None))
            if with_versions:
                versions.append(token_versions(len(out), s.weight_version, s.weight_versions))
    with_experts = [e is not None for e in experts]
    if any(with_experts) and not all(with_experts):
        raise ValueError("some samples carry routed_experts and others do not (mixed servers?)")
    return build_batch(
        **columns,
        pad_id=pad_id,
        routed_experts=experts if any(with_experts) else None,
        token_versions=versions if with_versions else None,
    )


def sample_groups(ctx: RunContext, prompts: list[Prompt], first_group: int) -> RolloutBatch:
    """Rank 0: sample ``rollout.n_samples_per_prompt`` completions of each prompt from the rollout
    backend (:class:`~megatron_acrl.rollout.backend.RolloutBackend`) and score them; with
    ``rollout.agent.agent`` or ``.env`` set, that many agent trajectories
    (:func:`~megatron_acrl.rollout.trajectories.sample_trajectories`)."""
    assert ctx.servers is not None
    if ctx.cfg.rollout.agent.agent is not None or ctx.cfg.rollout.agent.env is not None:
        return sample_trajectories(ctx, prompts, first_group)
    servers: RolloutBackend = ctx.servers
    cfg = ctx.cfg
    ids = encode_prompts(ctx.tokenizer, prompts, cfg.rollout.max_prompt_len)
    # No per-request sampling seeds: SGLang 0.5.23 reads `sampling_seed` only under
    # --enable-deterministic-inference, which it refuses with the CPU attention backends, so on a CPU
    # server a seed changes nothing (measured for issue #23: the same hashed per-sample seeds gave
    # other completions on a second request, and groups were as diverse as with the server's RNG,
    # 4.1-4.4 distinct of 8 either way). The servers' own RNG (--random-seed) is used; exact reruns
    # of the trainer side go through --save-rollouts / --load-rollouts.
    params = servers.sampling_params()
    groups = servers.generate(ids, cfg.rollout.n_samples_per_prompt, params)
    return score_groups(
        ctx.task,
        ctx.tokenizer,
        prompts,
        ids,
        groups,
        pad_id=ctx.pad_id,
        eos_id=ctx.eos_id,
        first_group_id=first_group,
        with_versions=True,
    )


def replayed_batch(ctx: RunContext, step: int) -> RolloutBatch:
    """Rank 0: the batch recorded for ``step`` in ``--load-rollouts``."""
    batch = load_rollouts(ctx.args.load_rollouts, step)
    if ctx.cfg.model.moe_routing_replay == "rollout" and batch.routed_experts is None:
        raise ValueError(
            f"--load-rollouts {ctx.args.load_rollouts}: step {step} was recorded without routed "
            "experts, which model.moe_routing_replay=rollout replays; record with an MoE model and "
            "rollout.return_routed_experts, or set moe_routing_replay: off / train"
        )
    return batch


def shape_rewards(b: RolloutBatch, ctx: RunContext) -> RolloutBatch:
    """``b`` with DAPO's overlong penalty added to its rewards ``[N]`` (when configured)."""
    r, a = ctx.cfg.rollout, ctx.cfg.algorithm
    if a.overlong_buffer_len:
        b.rewards = b.rewards + overlong_penalty(
            b.response_len,
            max_len=r.max_new_tokens,
            buffer_len=a.overlong_buffer_len,
            penalty=a.overlong_penalty,
        )
    return b


def generate_with_refill(ctx: RunContext, state: DriverState, step: int) -> tuple[RolloutBatch, int]:
    """Rank 0: ``rollout.prompts_per_step`` groups of fresh samples, and the generation rounds it took.

    With DAPO dynamic sampling, groups whose rewards are all equal are dropped and replaced by new
    prompts, for at most ``algorithm.max_refill_rounds`` rounds; after that the batch is topped up
    with dropped groups (zero advantage, no gradient) or, when those run out, unfiltered new ones.
    """
    assert ctx.prompt_stream is not None
    r, a = ctx.cfg.rollout, ctx.cfg.algorithm
    need = r.prompts_per_step
    kept: list[RolloutBatch] = []
    spare: list[RolloutBatch] = []  # groups dropped by dynamic sampling, used if refills run dry
    n_kept = rounds = 0
    while n_kept < need:
        prompts = [next(ctx.prompt_stream) for _ in range(need - n_kept)]
        state.prompts_consumed += len(prompts)
        b = shape_rewards(sample_groups(ctx, prompts, first_group=step * 1_000_000 + rounds * 10_000), ctx)
        if a.dynamic_sampling and rounds < a.max_refill_rounds:
            keep = dynamic_sampling_keep(b.rewards, b.group_ids)
            spare.append(b.select(torch.nonzero(~keep).flatten()))
            b = b.select(torch.nonzero(keep).flatten())
        kept.append(b)
        n_kept += len(b) // r.n_samples_per_prompt
        rounds += 1
        if a.dynamic_sampling and rounds >= a.max_refill_rounds and n_kept < need:
            # Out of refills: top up with constant-reward groups (zero advantage, no gradient).
            filler = RolloutBatch.concat(spare, ctx.pad_id) if spare else None
            if filler is not None and len(filler):
                take = min(len(filler), (need - n_kept) * r.n_samples_per_prompt)
                kept.append(filler.select(list(range(take))))
                n_kept += take // r.n_samples_per_prompt
            # Still short: the loop generates the rest without filtering.
    batch = RolloutBatch.concat(kept, ctx.pad_id) if len(kept) > 1 else kept[0]
    return batch, rounds


def _rank0_rollouts(ctx: RunContext, state: DriverState, step: int) -> tuple[RolloutBatch, dict[str, float]]:
    """Rank 0: this step's batch (replayed or generated, then recorded with ``--save-rollouts``)."""
    if ctx.args.load_rollouts:
        return replayed_batch(ctx, step), {"rollout/replayed": 1.0}
    batch, rounds = generate_with_refill(ctx, state, step)
    if ctx.args.save_rollouts:
        save_rollouts(batch, ctx.args.save_rollouts, step)
    assert ctx.servers is not None
    return batch, {"rollout/refill_rounds": float(rounds - 1), **ctx.servers.load_metrics()}


def _attempt(ctx: RunContext, state: DriverState, step: int, last: bool) -> Verdict:
    """Rank 0: one try at the step's rollouts, as ``(OK, (batch, metrics))``, ``(RETRY, why)``
    after a server failed and was repaired (a dead one restarted, a hung one killed and replaced, a
    dead router started again: :meth:`~megatron_acrl.servers.recovery.ServerRecovery.recover_rollout`;
    the prompts of the try given back), ``(STOPPED, why)`` when it failed after a stop was asked
    (:attr:`RunContext.stopping`; the prompts given back, nothing restarted), or ``(ERROR, why)``
    when no server failed (the request's own fault) or on the last try
    (:mod:`megatron_acrl.world.vote`)."""
    consumed = state.prompts_consumed
    try:
        return OK, _rank0_rollouts(ctx, state, step)
    except Exception as e:  # noqa: BLE001 - decided here, then told to every rank
        why = f"{type(e).__name__}: {e}"
        stopped = ctx.stopping()
        if not stopped:
            if last or ctx.servers is None:
                return ERROR, why
            try:
                done = ctx.servers.recover_rollout(e)
            except Exception as r:  # noqa: BLE001 - a repair that failed ends the run on every rank
                return ERROR, f"{why}; the repair failed: {type(r).__name__}: {r}"
            if done is None:
                return ERROR, why
            why = f"{why}; {done}"
        # the prompts of the try go back: a retry, or the resume, samples them again
        state.prompts_consumed = consumed
        ctx.prompt_stream = prompt_stream(ctx.task, ctx.cfg.training.seed, consumed)
        return (STOPPED if stopped else RETRY), why


def collect_rollouts(
    ctx: RunContext, state: DriverState, step: int, restore: Callable[[], object]
) -> tuple[RolloutBatch, dict[str, float]]:
    """Generate and reward one rollout batch on rank 0 and broadcast it to every rank.

    A server that dies mid-generation is restarted, the served weights re-sent (``restore``, on
    every rank), and the step retried with the same prompts; nothing is lost and nothing is trained
    twice. Once a stop was asked (:attr:`RunContext.stopping`, rank 0), a failed try raises
    :class:`~megatron_acrl.world.vote.StoppedWithoutServers` on every rank instead (rank 0 decides
    for every rank: :func:`megatron_acrl.world.vote.vote`).
    """

    def retry(attempt: int, why: str) -> None:
        log0(f"step {step + 1}: rollout failed ({why}); re-sending the served weights and retrying")
        restore()

    batch, metrics = vote(
        lambda attempt: _attempt(ctx, state, step, attempt == ATTEMPTS - 1) if ctx.rank == 0 else NO_VERDICT,
        attempts=ATTEMPTS,
        recover=retry,
        failed=lambda why, exhausted: f"rollout of step {step + 1} failed: {why}",
        stopped=lambda why: stopped_message(step, why),
    )
    metrics.update(rollout_metrics(batch))
    metrics.update(recovery_metrics(ctx))
    return batch, metrics


def recovery_metrics(ctx: RunContext) -> dict[str, float]:
    """Rank 0's repairs of the run so far: ``rollout/server_restarts`` (every restart),
    ``rollout/hung_restarts`` (servers killed and replaced because they hung, in a rollout or a
    weight sync), ``rollout/router_restarts`` (a dead sglang-router started again)."""
    s = ctx.servers
    if s is None:
        return {}
    return {
        "rollout/server_restarts": float(s.restarts),
        "rollout/hung_restarts": float(s.hung_restarts),
        "rollout/router_restarts": float(s.router_restarts),
    }


def stopped_message(step: int, why: str) -> str:
    """What the log says when a stop was asked and then loop index ``step``'s rollout failed."""
    return (
        f"step {step + 1}: a stop was asked and then its rollout failed ({why}); the servers are "
        f"going down with the job, so the run stops at step {step}, its last completed step, and "
        "checkpoints it"
    )


def rollout_metrics(batch: RolloutBatch) -> dict[str, float]:
    """The batch's reward, response length and finish statistics (``reward/*``, ``rollout/*``)."""
    lens = batch.response_len.float()
    finish = batch.finish_reasons or []
    return {
        "reward/mean": float(batch.rewards.mean()) if len(batch) else 0.0,
        "reward/std": float(batch.rewards.std()) if len(batch) > 1 else 0.0,
        "response_length/mean": float(lens.mean()) if len(batch) else 0.0,
        "response_length/max": float(lens.max()) if len(batch) else 0.0,
        "rollout/finish_length_frac": sum(f == "length" for f in finish) / max(len(finish), 1),
        "rollout/nonfinite_logprobs": float(batch.num_nonfinite_logprobs),
        "rollout/num_sequences": float(len(batch)),
        **agent_metrics(batch),
    }
