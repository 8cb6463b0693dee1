"""The driver's rollout phase: prompts -> n samples each from the servers -> rewards -> a batch.

Rank 0 draws prompts, generates through :class:`megatron_acrl.rollout_servers.RolloutServers`
(DAPO dynamic sampling refills dropped groups), scores and packs them into a
:class:`megatron_acrl.batch.RolloutBatch`, and broadcasts it to every rank. A server that dies
mid-rollout is restarted and the step retried with the same prompts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from megatron_acrl.advantages import dynamic_sampling_keep, overlong_penalty
from megatron_acrl.batch import RolloutBatch, build_batch, load_rollouts, save_rollouts
from megatron_acrl.distributed import broadcast_object, log0
from megatron_acrl.tasks.base import Prompt, Task
from sglang_bridge.client import ServerGoneError


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
) -> RolloutBatch:
    """Decode, reward and pack the samples of each prompt into a :class:`RolloutBatch`."""
    rows: dict[str, list[Any]] = {k: [] for k in ("p", "o", "lp", "r", "g", "f", "v", "pt", "ct", "re")}
    for gi, (prompt, pids, samples) in enumerate(zip(prompts, prompt_ids, groups, strict=True)):
        for s in samples:
            out = list(s.output_ids)
            text_ids = out[:-1] if out and eos_id is not None and out[-1] == eos_id else out
            completion = tokenizer.decode(text_ids, skip_special_tokens=True)
            rows["p"].append(list(pids))
            rows["o"].append(out)
            rows["lp"].append(list(s.rollout_logprobs))
            rows["r"].append(task.reward(prompt, completion))
            rows["g"].append(first_group_id + gi)
            rows["f"].append(s.finish_reason)
            rows["v"].append(str(s.weight_version))
            rows["pt"].append(prompt.text)
            rows["ct"].append(completion)
            rows["re"].append(getattr(s, "routed_experts", None))
    with_experts = [r is not None for r in rows["re"]]
    if any(with_experts) and not all(with_experts):
        raise ValueError("some samples carry routed_experts and others do not (mixed servers?)")
    return build_batch(
        rows["p"],
        rows["o"],
        rows["lp"],
        rewards=rows["r"],
        group_ids=rows["g"],
        pad_id=pad_id,
        finish_reasons=rows["f"],
        weight_versions=rows["v"],
        prompts=rows["pt"],
        completions=rows["ct"],
        routed_experts=rows["re"] if rows["re"] and all(with_experts) else None,
    )


def _generate_batch(ctx: Any, prompts: list[Prompt], step: int, first_group: int) -> RolloutBatch:
    """Rank 0: sample ``n`` completions of each prompt and score them."""
    cfg = ctx.cfg
    ids = encode_prompts(ctx.tokenizer, prompts, cfg.rollout.max_prompt_len)
    # No per-request sampling seeds: SGLang 0.5.23 on CPU repeats the same completions for different
    # prompts and steps when given consecutive seeds (measured: identical samples one request apart),
    # which collapses group diversity. The servers' own RNG (--random-seed) is used instead; exact
    # reruns of the trainer side go through --save-rollouts / --load-rollouts.
    params = ctx.servers.sampling_params()
    groups = ctx.servers.generate(ids, cfg.rollout.n_samples_per_prompt, params)
    return score_groups(
        ctx.task,
        ctx.tokenizer,
        prompts,
        ids,
        groups,
        pad_id=ctx.pad_id,
        eos_id=ctx.eos_id,
        first_group_id=first_group,
    )


def _rank0_rollouts(ctx: Any, state: Any, step: int) -> tuple[RolloutBatch, dict[str, float]]:
    cfg = ctx.cfg
    r, a = cfg.rollout, cfg.algorithm
    if ctx.args.load_rollouts:
        batch = load_rollouts(ctx.args.load_rollouts, step)
        if cfg.model.moe_routing_replay == "rollout" and batch.routed_experts is None:
            raise ValueError(
                f"--load-rollouts {ctx.args.load_rollouts}: step {step} was recorded without routed "
                "experts, which model.moe_routing_replay=rollout replays; record with an MoE model and "
                "rollout.return_routed_experts, or set moe_routing_replay: off / train"
            )
        return batch, {"rollout/replayed": 1.0}
    need = r.prompts_per_step
    kept: list[RolloutBatch] = []
    spare: list[RolloutBatch] = []  # groups dropped by dynamic sampling, used if refills run dry
    n_kept = rounds = 0
    while n_kept < need:
        prompts = [next(ctx.prompt_stream) for _ in range(need - n_kept)]
        state.prompts_consumed += len(prompts)
        b = _generate_batch(ctx, prompts, step, first_group=step * 1_000_000 + rounds * 10_000)
        if a.overlong_buffer_len:
            b.rewards = b.rewards + overlong_penalty(
                b.response_len,
                max_len=r.max_new_tokens,
                buffer_len=a.overlong_buffer_len,
                penalty=a.overlong_penalty,
            )
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
            if n_kept < need:
                continue  # generate the rest without filtering
    batch = RolloutBatch.concat(kept, ctx.pad_id) if len(kept) > 1 else kept[0]
    metrics = {"rollout/refill_rounds": float(rounds - 1)}
    if ctx.args.save_rollouts:
        save_rollouts(batch, ctx.args.save_rollouts, step)
    return batch, metrics


def collect_rollouts(ctx: Any, state: Any, step: int) -> tuple[RolloutBatch, dict[str, float]]:
    """Generate and reward one rollout batch on rank 0 and broadcast it to every rank.

    A server that dies mid-generation is restarted, the current weights re-sent, and the step
    retried with the same prompts; nothing is lost and nothing is trained twice.
    """
    for attempt in range(3):
        status: tuple[str, Any]
        if ctx.rank == 0:
            consumed = state.prompts_consumed
            try:
                status = ("ok", _rank0_rollouts(ctx, state, step))
            except Exception as e:  # noqa: BLE001 - decided below, on every rank
                gone = isinstance(e, ServerGoneError) or (
                    ctx.servers is not None and ctx.servers.dead_servers()
                )
                if not gone or attempt == 2:
                    status = ("error", f"{type(e).__name__}: {e}")
                else:
                    state.prompts_consumed = consumed
                    ctx.prompt_stream = _rewind(ctx, consumed)
                    ctx.servers.restart()
                    status = ("retry", f"{type(e).__name__}: {e}")
        else:
            status = ("", None)
        status = broadcast_object(status)
        if status[0] == "ok":
            batch, metrics = status[1]
            metrics.update(rollout_metrics(batch))
            if ctx.servers is not None:
                metrics["rollout/server_restarts"] = float(ctx.servers.restarts)
            return batch, metrics
        if status[0] == "error":
            raise RuntimeError(f"rollout of step {step} failed: {status[1]}")
        log0(f"step {step}: rollout server failed ({status[1]}); restarted, re-sending weights and retrying")
        ctx.push_weights(state.weight_version)
    raise RuntimeError("unreachable")


def _rewind(ctx: Any, consumed: int) -> Any:
    """A fresh prompt stream positioned after ``consumed`` prompts (same order as before)."""
    stream = ctx.task.train_prompts(seed=ctx.cfg.training.seed)
    if consumed:
        next(itertools.islice(stream, consumed - 1, consumed), None)
    return stream


def rollout_metrics(batch: RolloutBatch) -> dict[str, float]:
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
    }
