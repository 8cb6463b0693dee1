"""The rollout / train batch contract: assembly and padding, record and replay, minibatches.

Data contract (DESIGN.md): ``tokens [N, L]`` (prompt + response, right-padded), ``loss_mask
[N, L]`` (1 on response tokens), ``rollout_logprobs [N, L]`` float32 aligned so position t holds
``log mu(token t | tokens < t)`` (position 0 and padding hold 0), ``rewards [N]``, ``group_ids
[N]``, ``response_len [N]``; N = prompts x samples, grouped by prompt. MoE rollouts may carry
``routed_experts [N, L, num_layers, top_k]`` int16: position p holds the experts SGLang routed token p
to, -1 where there is no routing (each sequence's last token, which the engine never fed through the
model, and padding). Aligned with ``tokens``, not with the log-probs: the routing of position t-1
produced the distribution of token t. ``token_versions [N, L]`` int64: the weight version each
response token was sampled with (:mod:`megatron_acrl.batch.staleness`; a request paused across a weight
update carries two), -1 on prompt and padding positions; None in recordings made before it existed.
``turn_ids [N, L]`` int64: the agent turn (0, 1, ...) that generated each response token, -1 on
prompt, observation, boundary and padding positions (single-turn: 0 on the response); None in
recordings made before it existed.

Multi-turn (agent) rollouts: the "response" is everything after the opening prompt, the generated
turns with the observation and boundary tokens appended between them (token-in-token-out,
:mod:`megatron_acrl.rollout.agent.session`). ``generated`` per sample marks which response tokens
the server generated: only those get ``loss_mask`` 1, a rollout log-prob, a version and a turn.

:meth:`RolloutBatch.tensors` starts the step's train batch, which the policy completes (pi_old,
advantages, ...): its keys, shapes and dtypes are documented and checked in one place,
:mod:`megatron_acrl.batch.train_batch`; :func:`minibatches` cuts it for PPO epochs.

Non-finite rollout log-probs (an engine fault, seen in the field as NaN from overflowing FP8
kernels) are masked out of the loss and counted, so they never reach a gradient.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from megatron_acrl.batch.train_batch import TrainBatch

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
    token_versions: Tensor | None = None
    turn_ids: Tensor | None = None
    agent_rows: list[dict[str, float]] = field(default_factory=list)
    """Agent rollouts: per row, its trajectory's counts (turns, tool calls, ...) for ``agent/*``."""

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def tensors(self) -> TrainBatch:
        """The train batch's required keys (and ``routed_experts``, ``token_versions`` when present)."""
        out = TrainBatch(
            tokens=self.tokens,
            loss_mask=self.loss_mask,
            rollout_logprobs=self.rollout_logprobs,
            rewards=self.rewards,
            group_ids=self.group_ids,
            response_len=self.response_len,
        )
        if self.routed_experts is not None:
            out["routed_experts"] = self.routed_experts
        if self.token_versions is not None:
            out["token_versions"] = self.token_versions
        if self.turn_ids is not None:
            out["turn_ids"] = self.turn_ids
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
            agent_rows=[self.agent_rows[i] for i in pick] if self.agent_rows else [],
            num_nonfinite_logprobs=self.num_nonfinite_logprobs,
            routed_experts=self.routed_experts[idx] if self.routed_experts is not None else None,
            token_versions=self.token_versions[idx] if self.token_versions is not None else None,
            turn_ids=self.turn_ids[idx] if self.turn_ids is not None else None,
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
        for k in ("finish_reasons", "weight_versions", "prompts", "completions", "agent_rows"):
            out[k] = [x for b in batches for x in getattr(b, k)]
        out["num_nonfinite_logprobs"] = sum(b.num_nonfinite_logprobs for b in batches)
        experts = [b.routed_experts for b in batches]
        if any(e is not None for e in experts):
            if any(e is None for e in experts):
                raise ValueError("cannot concatenate rollout batches with and without routed_experts")
            out["routed_experts"] = torch.cat(
                [torch.nn.functional.pad(e, (0, 0, 0, 0, 0, width - e.shape[1]), value=-1) for e in experts]
            )
        for key in ("token_versions", "turn_ids"):
            parts = [getattr(b, key) for b in batches]
            if any(v is not None for v in parts):
                if any(v is None for v in parts):
                    raise ValueError(f"cannot concatenate rollout batches with and without {key}")
                out[key] = torch.cat([pad(v, -1) for v in parts])
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
    rollout_logprobs: Sequence[Sequence[float]],
    *,
    rewards: Sequence[float],
    group_ids: Sequence[int],
    pad_id: int,
    finish_reasons: Sequence[str] = (),
    weight_versions: Sequence[str] = (),
    prompts: Sequence[str] = (),
    completions: Sequence[str] = (),
    routed_experts: Sequence[Any] | None = None,
    token_versions: Sequence[Sequence[int]] | None = None,
    generated: Sequence[Sequence[int]] | None = None,
    turn_ids: Sequence[Sequence[int]] | None = None,
) -> RolloutBatch:
    """Assemble right-padded tensors from per-sample token lists (see module doc for layout).

    Per sample: ``prompt_ids`` (P >= 1 tokens), ``output_ids`` (O tokens) and their
    ``rollout_logprobs`` (O floats, ``log mu`` of each output token as the engine sampled it);
    ``routed_experts``: per sample ``[P + O - 1, num_layers, top_k]`` integers (SGLang's routing of
    positions 0 .. P+O-2), or None; ``token_versions``: per sample O weight versions, or None.
    Multi-turn: ``generated`` per sample O flags (1: the server generated it; 0: an observation or
    boundary token, whose log-prob is ignored and whose version/turn must be -1) and ``turn_ids``
    per sample O turn indices; None (single-turn): every output token generated, in turn 0.
    """
    n = len(prompt_ids)
    if not (len(output_ids) == len(rollout_logprobs) == len(rewards) == len(group_ids) == n):
        raise ValueError(
            "build_batch: prompt_ids, output_ids, rollout_logprobs, rewards, group_ids differ in length"
        )
    width = max(len(p) + len(o) for p, o in zip(prompt_ids, output_ids, strict=True))
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.float32)
    logprobs = torch.zeros(n, width, dtype=torch.float32)
    for i, (p, o, o_logprobs) in enumerate(zip(prompt_ids, output_ids, rollout_logprobs, strict=True)):
        _fill_row(i, p, o, o_logprobs, None if generated is None else generated[i], tokens, mask, logprobs)
    is_generated = mask > 0
    logprobs, mask, bad = sanitize_logprobs(logprobs, mask)
    experts = None
    if routed_experts is not None:
        experts = _routing_tensor(routed_experts, prompt_ids, output_ids, width)
    versions = None
    if token_versions is not None:
        versions = _versions_tensor(token_versions, prompt_ids, output_ids, width)
    turns = _versions_tensor(
        turn_ids if turn_ids is not None else [[0] * len(o) for o in output_ids],
        prompt_ids,
        output_ids,
        width,
    )
    return RolloutBatch(
        tokens=tokens,
        loss_mask=mask,
        rollout_logprobs=logprobs,
        rewards=torch.tensor(list(rewards), dtype=torch.float32),
        group_ids=torch.tensor(list(group_ids), dtype=torch.long),
        response_len=torch.tensor([len(o) for o in output_ids], dtype=torch.long),
        finish_reasons=list(finish_reasons),
        weight_versions=list(weight_versions),
        prompts=list(prompts),
        completions=list(completions),
        num_nonfinite_logprobs=bad,
        routed_experts=experts,
        token_versions=versions,
        turn_ids=turns.masked_fill(~is_generated, -1),
    )


def _fill_row(
    i: int,
    p: Sequence[int],
    o: Sequence[int],
    o_logprobs: Sequence[float],
    generated: Sequence[int] | None,
    tokens: Tensor,
    mask: Tensor,
    logprobs: Tensor,
) -> None:
    """Write sample ``i`` into row i of ``tokens``, ``mask`` and ``logprobs`` (all ``[N, width]``):
    ``mask`` 1 and the log-prob on the output ids the server generated (all of them when
    ``generated`` is None), 0 on the prompt and on observation / boundary ids."""
    if len(o_logprobs) != len(o):
        raise ValueError(f"sample {i}: {len(o_logprobs)} log-probs for {len(o)} output tokens")
    if not p:
        raise ValueError(f"sample {i}: empty prompt (position 0 has no log-prob, so a prompt is required)")
    tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    if not o:
        return
    tokens[i, len(p) : len(p) + len(o)] = torch.tensor(o, dtype=torch.long)
    gen = torch.ones(len(o)) if generated is None else torch.tensor(list(generated), dtype=torch.float32)
    if gen.numel() != len(o):
        raise ValueError(f"sample {i}: {gen.numel()} generated flags for {len(o)} output tokens")
    mask[i, len(p) : len(p) + len(o)] = gen
    # observation / boundary ids have no log-prob: 0 there, whatever the caller held
    lp = torch.tensor(o_logprobs, dtype=torch.float32)
    logprobs[i, len(p) : len(p) + len(o)] = torch.where(gen > 0, lp, torch.zeros_like(lp))


def _versions_tensor(
    versions: Sequence[Sequence[int]],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    width: int,
) -> Tensor:
    """``[N, width]`` int64 weight versions on response positions, -1 elsewhere."""
    if len(versions) != len(prompt_ids):
        raise ValueError(f"{len(versions)} token_versions for {len(prompt_ids)} samples")
    out = torch.full((len(versions), width), -1, dtype=torch.long)
    for i, (v, p, o) in enumerate(zip(versions, prompt_ids, output_ids, strict=True)):
        if len(v) != len(o):
            raise ValueError(f"sample {i}: {len(v)} token versions for {len(o)} output tokens")
        if v:
            out[i, len(p) : len(p) + len(o)] = torch.tensor(list(v), dtype=torch.long)
    return out


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


def minibatches(tb: TrainBatch, cfg: Any, seed: int) -> Iterator[TrainBatch]:
    """PPO epochs x minibatches over a train batch; each epoch reshuffles whole groups.

    With one epoch and one minibatch this yields the batch itself (the GRPO default: one optimizer
    step per rollout batch, strictly on-policy w.r.t. pi_old).
    """
    a = cfg.algorithm
    n = tb["tokens"].shape[0]
    columns = cast(dict[str, Tensor], tb)
    if a.ppo_epochs == 1 and a.num_minibatches == 1:
        yield tb
        return
    size = n // a.num_minibatches
    g = torch.Generator().manual_seed(seed)
    for _ in range(a.ppo_epochs):
        order = torch.randperm(n, generator=g)
        for k in range(a.num_minibatches):
            idx = order[k * size : (k + 1) * size]
            yield cast(
                TrainBatch,
                {k: (v[idx] if v.dim() >= 1 and v.shape[0] == n else v) for k, v in columns.items()},
            )
