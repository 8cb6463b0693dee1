"""Prompts -> rollout batch: generation through the bridge's client, padding, record and replay.

Data contract (DESIGN.md): ``tokens [N, L]`` (prompt + response, right-padded), ``loss_mask
[N, L]`` (1 on response tokens), ``rollout_logprobs [N, L]`` float32 aligned so position t holds
``log mu(token t | tokens < t)`` (position 0 and padding hold 0), ``rewards [N]``, ``group_ids
[N]``, ``response_len [N]``; N = prompts x samples, grouped by prompt. MoE rollouts may carry
``routed_experts [N, L, num_layers, top_k]`` int16: position p holds the experts SGLang routed token p
to, -1 where there is no routing (each sequence's last token, which the engine never fed through the
model, and padding). Aligned with ``tokens``, not with the log-probs: the routing of position t-1
produced the distribution of token t.

Non-finite rollout log-probs (an engine fault, seen in the field as NaN from overflowing FP8
kernels) are masked out of the loss and counted, so they never reach a gradient.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_acrl.tasks.base import Prompt, Task

TENSOR_FIELDS = ("tokens", "loss_mask", "rollout_logprobs", "rewards", "group_ids", "response_len")


@dataclass
class RolloutBatch:
    """One rollout batch (see module doc for shapes). Text fields are for logs and tables."""

    tokens: Tensor
    loss_mask: Tensor
    rollout_logprobs: Tensor
    rewards: Tensor
    group_ids: Tensor
    response_len: Tensor
    finish_reasons: list[str] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    num_nonfinite_logprobs: int = 0
    routed_experts: Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def tensors(self) -> dict[str, Tensor]:
        out = {k: getattr(self, k) for k in TENSOR_FIELDS}
        if self.routed_experts is not None:
            out["routed_experts"] = self.routed_experts
        return out

    def select(self, index: Sequence[int] | Tensor) -> RolloutBatch:
        """Rows ``index`` (e.g. groups kept by DAPO dynamic sampling)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        pick = idx.tolist()
        return RolloutBatch(
            **{k: getattr(self, k)[idx] for k in TENSOR_FIELDS},
            finish_reasons=[self.finish_reasons[i] for i in pick] if self.finish_reasons else [],
            weight_versions=[self.weight_versions[i] for i in pick] if self.weight_versions else [],
            prompts=[self.prompts[i] for i in pick] if self.prompts else [],
            completions=[self.completions[i] for i in pick] if self.completions else [],
            num_nonfinite_logprobs=self.num_nonfinite_logprobs,
            routed_experts=self.routed_experts[idx] if self.routed_experts is not None else None,
        )

    @staticmethod
    def concat(batches: Sequence[RolloutBatch], pad_id: int = 0) -> RolloutBatch:
        """Stack batches (right-padding to the longest)."""
        width = max(b.tokens.shape[1] for b in batches)

        def pad(t: Tensor, value: float) -> Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        out: dict[str, Any] = {
            "tokens": torch.cat([pad(b.tokens, pad_id) for b in batches]),
            "loss_mask": torch.cat([pad(b.loss_mask, 0) for b in batches]),
            "rollout_logprobs": torch.cat([pad(b.rollout_logprobs, 0) for b in batches]),
        }
        for k in ("rewards", "group_ids", "response_len"):
            out[k] = torch.cat([getattr(b, k) for b in batches])
        for k in ("finish_reasons", "weight_versions", "prompts", "completions"):
            out[k] = [x for b in batches for x in getattr(b, k)]
        out["num_nonfinite_logprobs"] = sum(b.num_nonfinite_logprobs for b in batches)
        experts = [b.routed_experts for b in batches]
        if any(e is not None for e in experts):
            if any(e is None for e in experts):
                raise ValueError("cannot concatenate rollout batches with and without routed_experts")
            out["routed_experts"] = torch.cat(
                [torch.nn.functional.pad(e, (0, 0, 0, 0, 0, width - e.shape[1]), value=-1) for e in experts]
            )
        return RolloutBatch(**out)

    # -- record / replay ------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write the batch to ``path`` (a ``.pt`` file) atomically."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        torch.save({f.name: getattr(self, f.name) for f in fields(self)}, tmp)
        tmp.replace(p)

    @staticmethod
    def load(path: str | Path) -> RolloutBatch:
        data = torch.load(Path(path), weights_only=False)
        return RolloutBatch(**data)


def sanitize_logprobs(logprobs: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """Mask non-finite rollout log-probs out of the loss.

    Args:
        logprobs: ``[N, L]`` rollout log-probs. loss_mask: ``[N, L]``.
    Returns:
        ``(logprobs with 0 where masked, loss_mask with those tokens removed, count)``.
    """
    bad = ~torch.isfinite(logprobs) & (loss_mask > 0)
    count = int(bad.sum())
    if count:
        logprobs = torch.where(bad, torch.zeros_like(logprobs), logprobs)
        loss_mask = loss_mask * (~bad).to(loss_mask.dtype)
    return logprobs, loss_mask, count


def build_batch(
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    output_logprobs: Sequence[Sequence[float]],
    *,
    rewards: Sequence[float],
    group_ids: Sequence[int],
    pad_id: int,
    finish_reasons: Sequence[str] = (),
    weight_versions: Sequence[str] = (),
    prompts: Sequence[str] = (),
    completions: Sequence[str] = (),
    routed_experts: Sequence[Any] | None = None,
) -> RolloutBatch:
    """Assemble right-padded tensors from per-sample token lists (see module doc for layout).

    ``routed_experts``: per sample ``[P + O - 1, num_layers, top_k]`` integers (SGLang's routing of
    positions 0 .. P+O-2), or None.
    """
    n = len(prompt_ids)
    if not (len(output_ids) == len(output_logprobs) == len(rewards) == len(group_ids) == n):
        raise ValueError(
            "build_batch: prompt_ids, output_ids, output_logprobs, rewards, group_ids differ in length"
        )
    width = max(len(p) + len(o) for p, o in zip(prompt_ids, output_ids, strict=True))
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.float32)
    lps = torch.zeros(n, width, dtype=torch.float32)
    for i, (p, o, lp) in enumerate(zip(prompt_ids, output_ids, output_logprobs, strict=True)):
        if len(lp) != len(o):
            raise ValueError(f"sample {i}: {len(lp)} log-probs for {len(o)} output tokens")
        if not p:
            raise ValueError(
                f"sample {i}: empty prompt (position 0 has no log-prob, so a prompt is required)"
            )
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        if o:
            tokens[i, len(p) : len(p) + len(o)] = torch.tensor(o, dtype=torch.long)
            mask[i, len(p) : len(p) + len(o)] = 1.0
            lps[i, len(p) : len(p) + len(o)] = torch.tensor(lp, dtype=torch.float32)
    lps, mask, bad = sanitize_logprobs(lps, mask)
    experts = None
    if routed_experts is not None:
        experts = _routing_tensor(routed_experts, prompt_ids, output_ids, width)
    return RolloutBatch(
        tokens=tokens,
        loss_mask=mask,
        rollout_logprobs=lps,
        rewards=torch.tensor(list(rewards), dtype=torch.float32),
        group_ids=torch.tensor(list(group_ids), dtype=torch.long),
        response_len=torch.tensor([len(o) for o in output_ids], dtype=torch.long),
        finish_reasons=list(finish_reasons),
        weight_versions=list(weight_versions),
        prompts=list(prompts),
        completions=list(completions),
        num_nonfinite_logprobs=bad,
        routed_experts=experts,
    )


def _routing_tensor(
    routed: Sequence[Any],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    width: int,
) -> Tensor:
    """``[N, width, layers, k]`` int16 from per-sample ``[P + O - 1, layers, k]`` arrays; -1 elsewhere."""
    arrays = [torch.as_tensor(r) for r in routed]
    if len(arrays) != len(prompt_ids):
        raise ValueError(f"{len(arrays)} routed_experts for {len(prompt_ids)} samples")
    shape = arrays[0].shape[1:]
    out = torch.full((len(arrays), width, *shape), -1, dtype=torch.int16)
    for i, (r, p, o) in enumerate(zip(arrays, prompt_ids, output_ids, strict=True)):
        rows = len(p) + len(o) - 1
        if r.dim() != 3 or r.shape[0] != rows or r.shape[1:] != shape:
            raise ValueError(
                f"sample {i}: routed_experts of shape {tuple(r.shape)}, expected [{rows}, *{tuple(shape)}] "
                "(one row per position but the last)"
            )
        if rows and (int(r.max()) >= 2**15 or int(r.min()) < 0):
            raise ValueError(f"sample {i}: routed expert ids outside [0, 32767]")
        out[i, :rows] = r.to(torch.int16)
    return out


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


async def generate_groups(
    clients: Sequence[Any],
    prompt_ids: Sequence[Sequence[int]],
    params: Any,
    n: int,
) -> list[list[Any]]:
    """``n`` samples per prompt, prompts spread round-robin over ``clients`` (one per server)."""
    shards: list[list[int]] = [[] for _ in clients]
    for i in range(len(prompt_ids)):
        shards[i % len(clients)].append(i)
    results = await asyncio.gather(
        *[
            c.generate([prompt_ids[i] for i in idx], params, n)
            for c, idx in zip(clients, shards, strict=True)
            if idx
        ]
    )
    groups: list[list[Any]] = [[] for _ in prompt_ids]
    for idx, res in zip([s for s in shards if s], results, strict=True):
        for i, g in zip(idx, res, strict=True):
            groups[i] = g
    return groups


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
            rows["lp"].append(list(s.logprobs))
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


def save_rollouts(batch: RolloutBatch, directory: str | Path, step: int) -> Path:
    """Record ``batch`` as ``<dir>/step_<step>.pt`` (and an index for humans)."""
    d = Path(directory)
    path = d / f"step_{step:06d}.pt"
    batch.save(path)
    with open(d / "index.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "step": step,
                    "file": path.name,
                    "n": len(batch),
                    "reward_mean": float(batch.rewards.mean()) if len(batch) else 0.0,
                }
            )
            + "\n"
        )
    return path


def load_rollouts(directory: str | Path, step: int) -> RolloutBatch:
    """Replay the batch recorded for ``step``; a clear error if the recording has no such step."""
    path = Path(directory) / f"step_{step:06d}.pt"
    if not path.is_file():
        have = sorted(p.name for p in Path(directory).glob("step_*.pt"))
        raise FileNotFoundError(
            f"--load-rollouts {directory}: no recorded batch for step {step} (have {len(have)}: "
            f"{have[:3]}{'...' if len(have) > 3 else ''})"
        )
    return RolloutBatch.load(path)


# ----------------------------------------------------------------------------------------------
# The driver's rollout phase (generate -> reward), evaluation and logging extras
# ----------------------------------------------------------------------------------------------


def _generate_batch(ctx: Any, prompts: list[Prompt], step: int, first_group: int) -> RolloutBatch:
    """Rank 0: sample ``n`` completions of each prompt and score them."""
    cfg = ctx.cfg
    ids = encode_prompts(ctx.tokenizer, prompts, cfg.rollout.max_prompt_len)
    # No per-request sampling seeds: SGLang 0.5.23 on CPU repeats the same completions for different
    # prompts and steps when given consecutive seeds (measured: identical samples one request apart),
    # which collapses group diversity. The servers' own RNG (--random-seed) is used instead; exact
    # reruns of the trainer side go through --save-rollouts / --load-rollouts.
    params = ctx.engine.sampling_params()
    groups = ctx.engine.generate(ids, cfg.rollout.n_samples_per_prompt, params)
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
    from megatron_acrl.advantages import dynamic_sampling_keep, overlong_penalty

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
    from megatron_acrl.runtime import broadcast_object

    for attempt in range(3):
        status: tuple[str, Any]
        if ctx.rank == 0:
            consumed = state.prompts_consumed
            try:
                status = ("ok", _rank0_rollouts(ctx, state, step))
            except Exception as e:  # noqa: BLE001 - decided below, on every rank
                from sglang_bridge.client import ServerGoneError

                gone = isinstance(e, ServerGoneError) or (
                    ctx.engine is not None and ctx.engine.dead_servers()
                )
                if not gone or attempt == 2:
                    status = ("error", f"{type(e).__name__}: {e}")
                else:
                    state.prompts_consumed = consumed
                    ctx.prompt_stream = _rewind(ctx, consumed)
                    ctx.engine.restart()
                    status = ("retry", f"{type(e).__name__}: {e}")
        else:
            status = ("", None)
        status = broadcast_object(status)
        if status[0] == "ok":
            batch, metrics = status[1]
            metrics.update(rollout_metrics(batch))
            if ctx.engine is not None:
                metrics["rollout/server_restarts"] = float(ctx.engine.restarts)
            return batch, metrics
        if status[0] == "error":
            raise RuntimeError(f"rollout of step {step} failed: {status[1]}")
        from megatron_acrl.runtime import log0

        log0(f"step {step}: rollout server failed ({status[1]}); restarted, re-sending weights and retrying")
        ctx.sync_weights(state.weight_version)
    raise RuntimeError("unreachable")


def _rewind(ctx: Any, consumed: int) -> Any:
    """A fresh prompt stream positioned after ``consumed`` prompts (same order as before)."""
    import itertools

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


def evaluate(ctx: Any, step: int, version: str) -> dict[str, float]:
    """Evaluate the served policy: greedy accuracy and mean response length on the held-out split
    (``eval/accuracy``, ``eval/response_length``) and, with ``training.eval_samples``, the sampled
    reward on fixed training prompts (``eval/sampled_reward``). With ``training.eval_trainer_weights``
    the same again on the trainer's unquantized weights (``eval_trainer/*``), after which the
    rollout's copy (``version``) is pushed back. Every rank calls this (the pushes are collective);
    rank 0 evaluates, the others get {}."""
    m = _evaluate_served(ctx, "eval")
    if ctx.cfg.training.eval_trainer_weights:
        if ctx.cfg.rollout.quantization == "none":  # the served weights are the trainer's
            m.update({"eval_trainer/" + k.split("/", 1)[1]: v for k, v in m.items()})
        else:
            ctx.sync_weights(f"{version}+unquantized", quantize=False)
            m.update(_evaluate_served(ctx, "eval_trainer"))
            ctx.sync_weights(version)
    return m


def _evaluate_served(ctx: Any, prefix: str) -> dict[str, float]:
    if ctx.rank != 0 or ctx.engine is None:
        return {}
    cfg, m = ctx.cfg, {}

    def scored(prompts: list[Any], n: int, params: Any) -> RolloutBatch:
        ids = encode_prompts(ctx.tokenizer, prompts, cfg.rollout.max_prompt_len)
        groups = ctx.engine.generate(ids, n, params)
        return score_groups(
            ctx.task, ctx.tokenizer, prompts, ids, groups, pad_id=ctx.pad_id, eos_id=ctx.eos_id
        )

    if prompts := ctx.task.eval_prompts(cfg.task.eval_size):
        b = scored(prompts, 1, ctx.engine.sampling_params(greedy=True))
        m[f"{prefix}/accuracy"] = float(b.rewards.mean())
        m[f"{prefix}/response_length"] = float(b.response_len.float().mean())
    if cfg.training.eval_samples:
        prompts = fixed_train_prompts(ctx.task, cfg.task.eval_size)
        b = scored(prompts, cfg.training.eval_samples, ctx.engine.sampling_params())
        m[f"{prefix}/sampled_reward"] = float(b.rewards.mean())
    return m


def fixed_train_prompts(task: Any, n: int) -> list[Any]:
    """The first ``n`` distinct training prompts of a fixed order (the task's seed-0 stream), the same
    at every eval and in every run."""
    seen: dict[int, Any] = {}
    for p in itertools.islice(task.train_prompts(seed=0), 4 * n):
        seen.setdefault(p.uid, p)
        if len(seen) == n:
            break
    return list(seen.values())


def log_extras(cfg: Any, batch: RolloutBatch, tb: dict[str, Tensor], step: int) -> dict[str, Any]:
    """Histogram of per-token log(pi_old / mu) and, every N steps, a table of sample completions."""
    mask = tb["loss_mask"] > 0
    out: dict[str, Any] = {
        "histograms": {"mismatch/log_ratio_hist": (tb["old_logprobs"] - tb["rollout_logprobs"])[mask].numpy()}
    }
    n = cfg.logging.sample_table_interval
    if n and step % n == 0 and batch.prompts:
        rows = [
            [batch.prompts[i], batch.completions[i], float(batch.rewards[i])]
            for i in range(min(8, len(batch)))
        ]
        out["table"] = (["prompt", "completion", "reward"], rows)
    return out
