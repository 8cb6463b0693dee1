"""Supervised warm-start: teach the tiny model the task's answer format so RL starts from a policy
that is right some of the time. Runs on the same Megatron trainer (same ranks and layout) with the
token NLL loss, and writes an HF checkpoint that both the trainer and SGLang load. Cached by a hash
of everything that determines it, so every arm of a study shares one warm start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_acrl.config import Config, config_to_dict
from megatron_acrl.tasks import make_task


def sft_cache_key(cfg: Config, base_dir: str | Path) -> str:
    src = json.dumps(
        [
            str(base_dir),
            # Routing replay changes how RL passes route, not the warm-started weights: arms that
            # differ only in it share one warm start (and keys predating the field stay valid).
            # LoRA adapts the RL policy, not the warm start (full SFT, below): LoRA and full-parameter
            # arms share one warm start, so they start RL from the same base.
            {
                k: v
                for k, v in config_to_dict(dataclasses.replace(cfg.model, lora=None)).items()
                if k != "moe_routing_replay"
            },
            # task.heldout_fraction at its default (the split before the field existed) keeps old keys.
            {k: v for k, v in config_to_dict(cfg.task).items() if (k, v) != ("heldout_fraction", 0.1)},
            cfg.training.sft_steps,
            cfg.training.sft_lr,
            cfg.training.sft_batch_size,
            cfg.training.seed,
            # agent warm starts train tool-call traces; a key without an env stays what it was
            # (v2: compact args-first calls, short instructions, direct answers in the last steps;
            # v3: tool traces until the copy is learned, then the mixed tail)
            *([f"agent-env={cfg.rollout.agent.env}:v3"] if _traces(cfg) else []),
        ],
        sort_keys=True,
    )
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def sft_batch(prompts: list[Any], tokenizer: Any, eos_id: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Prompt + answer + EOS, right-padded; the loss mask covers the answer and EOS."""
    seqs, masks = [], []
    for p in prompts:
        pids = tokenizer.encode(p.text, add_special_tokens=False)
        aids = tokenizer.encode(p.answer, add_special_tokens=False) + [eos_id]
        seqs.append(pids + aids)
        masks.append([0] * len(pids) + [1] * len(aids))
    return _padded(list(zip(seqs, masks, strict=True)), pad_id)


def _traces(cfg: Config) -> bool:
    """Whether the warm start trains tool-call traces (the calculator env) instead of answers."""
    return cfg.rollout.agent.env == "calculator"


def trace_batch(
    prompts: list[Any], tokenizer: Any, pad_id: int, direct: list[bool] | None = None
) -> dict[str, torch.Tensor]:
    """Correct calculator episodes (:mod:`megatron_acrl.warmstart.agent_traces`), right-padded; the
    loss mask covers the assistant turns (the tool call, the answer, their end-of-turn ids).
    ``direct[i]``: prompt i's trace answers without the tool."""
    from megatron_acrl.warmstart.agent_traces import calculator_trace, hf_render, trace_ids

    render = hf_render(tokenizer)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    direct = direct or [False] * len(prompts)
    rows = [
        trace_ids(calculator_trace(p.text, p.answer, use_tool=not d), render, encode)
        for p, d in zip(prompts, direct, strict=True)
    ]
    return _padded(rows, pad_id)


def _padded(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, (ids, m) in enumerate(rows):
        tokens[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    zeros = torch.zeros_like(mask)
    return {
        "tokens": tokens,
        "loss_mask": mask,
        "old_logprobs": zeros,
        "rollout_logprobs": zeros,
        "advantages": zeros,
    }


def sft_warmstart(
    cfg: Config, base_dir: str | Path, cache_root: str | Path, tokenizer: Any, log: Any = print
) -> Path:
    """Run (or reuse) the warm-start; every trainer rank calls it. Returns the checkpoint directory."""
    from megatron_acrl.algo.losses import sft_loss
    from megatron_acrl.megatron.policy import Policy
    from megatron_acrl.warmstart.agent_traces import MIXED_TAIL

    out = Path(cache_root) / f"sft-{sft_cache_key(cfg, base_dir)}"
    if out.is_dir():
        return out
    t = cfg.training
    sft_cfg = dataclasses.replace(
        cfg,
        training=dataclasses.replace(
            t,
            lr=t.sft_lr,
            # Tool-call traces: constant LR, so the last steps' direct answers (agent_traces.MIXED_TAIL)
            # move the policy as much as the first steps' traces did; cosine to 0 would leave them none.
            min_lr=t.sft_lr if _traces(cfg) else 0.0,
            lr_warmup_steps=0,
            weight_decay=0.0,
            micro_batch_size=min(t.micro_batch_size, t.sft_batch_size),
        ),
        correction=dataclasses.replace(cfg.correction, method="none"),
        algorithm=dataclasses.replace(cfg.algorithm, kl_coef=0.0, entropy_coef=0.0),
        # Supervised batches have no rollout routing to replay.
        model=dataclasses.replace(cfg.model, moe_routing_replay="off", lora=None),
    )
    trainer = Policy(sft_cfg, loss_fn=sft_loss, total_steps=t.sft_steps)
    trainer.load_hf(base_dir)
    task = make_task(cfg.task)
    stream = task.train_prompts(seed=t.seed + 7919)  # not the RL stream: RL prompts stay unseen
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    n = t.sft_batch_size - t.sft_batch_size % (trainer.dp_size * sft_cfg.training.micro_batch_size) or (
        trainer.dp_size * sft_cfg.training.micro_batch_size
    )
    traces = _traces(cfg)
    tail = round(MIXED_TAIL * t.sft_steps) if traces else 0
    schedule = _TraceSchedule(t.sft_steps, tail, t.seed)
    step = 0
    while step < schedule.total:
        prompts = list(itertools.islice(stream, n))
        if traces:
            batch = trace_batch(prompts, tokenizer, pad, schedule.direct(step, len(prompts)))
        else:
            batch = sft_batch(prompts, tokenizer, eos, pad)
        metrics = trainer.train_step(batch)
        if traces and schedule.observe(step, float(metrics.get("sft/nll", float("inf")))):
            log(f"sft step {step}: tool-call copy learned; {tail} mixed steps follow")
        if dist.get_rank() == 0 and (step % 20 == 0 or step == schedule.total - 1):
            log(f"sft step {step}/{schedule.total}: nll {metrics.get('sft/nll', float('nan')):.4f}")
        step += 1
    # As served: bf16, the base tokenizer. Two runs of the same key may both get here (no lock: the
    # ranks of a run would have to wait on it together); the first to finish is kept, and the other
    # run, which may already serve it, never sees it replaced.
    trainer.save_hf(out, base_dir=base_dir, dtype=torch.bfloat16, keep_existing=True)
    del trainer
    return out


class _TraceSchedule:
    """The tool-trace warm start's two phases: tool traces alone until the copy is learned (their
    NLL's mean over the last ``COPY_WINDOW`` steps below ``COPY_NLL`` on every rank, or the first
    ``sft_steps - tail`` steps at most), then ``tail`` steps that mix in direct answers. ``total`` is
    the step count, shortened once the copy is learned early."""

    def __init__(self, sft_steps: int, tail: int, seed: int):
        self.total, self.tail, self.seed = sft_steps, tail, seed
        self.tail_start = sft_steps - tail
        self._recent: list[float] = []

    def direct(self, step: int, n: int) -> list[bool]:
        from megatron_acrl.warmstart.agent_traces import direct_answer

        return direct_answer(step, self.tail_start, n, self.seed)

    def observe(self, step: int, nll: float) -> bool:
        """Note step ``step``'s NLL; True when the copy became learned at it (the tail starts next)."""
        from megatron_acrl.warmstart.agent_traces import COPY_NLL, COPY_WINDOW

        if step >= self.tail_start - 1:
            return False
        self._recent = [*self._recent[-(COPY_WINDOW - 1) :], nll]
        mean = sum(self._recent) / len(self._recent) if len(self._recent) == COPY_WINDOW else float("inf")
        # Every rank must switch at the same step (their batches' collectives must match): the worst.
        worst = torch.tensor([mean], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if worst.item() >= COPY_NLL:
            return False
        self.tail_start, self.total = step + 1, step + 1 + self.tail
        return True
