"""Prompts -> rollout batch: generation through the bridge's client, padding, record and replay.

Data contract (DESIGN.md): ``tokens [N, L]`` (prompt + response, right-padded), ``loss_mask
[N, L]`` (1 on response tokens), ``rollout_logprobs [N, L]`` float32 aligned so position t holds
``log mu(token t | tokens < t)`` (position 0 and padding hold 0), ``rewards [N]``, ``group_ids
[N]``, ``response_len [N]``; N = prompts x samples, grouped by prompt.

Non-finite rollout log-probs (an engine fault, seen in the field as NaN from overflowing FP8
kernels) are masked out of the loss and counted, so they never reach a gradient.
"""

from __future__ import annotations

import asyncio
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

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def tensors(self) -> dict[str, Tensor]:
        return {k: getattr(self, k) for k in TENSOR_FIELDS}

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
) -> RolloutBatch:
    """Assemble right-padded tensors from per-sample token lists (see module doc for layout)."""
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
    )


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
    rows: dict[str, list[Any]] = {k: [] for k in ("p", "o", "lp", "r", "g", "f", "v", "pt", "ct")}
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
