"""Evaluation of the served policy (and, on request, of the trainer's own unquantized weights).

Greedy accuracy on the held-out split, the sampled reward on fixed training prompts; every rank
calls :func:`evaluate` (the weight pushes it makes are collective), rank 0 evaluates.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_acrl.batch import RolloutBatch
from megatron_acrl.rollout import encode_prompts, score_groups
from megatron_acrl.tasks.base import Prompt, Task

if TYPE_CHECKING:
    from megatron_acrl.context import RunContext


def evaluate(
    ctx: RunContext, step: int, version: str, restore: Callable[[], object] | None = None
) -> dict[str, float]:
    """Evaluate the served policy: greedy accuracy and mean response length on the held-out split
    (``eval/accuracy``, ``eval/response_length``) and, with ``training.eval_samples``, the sampled
    reward on fixed training prompts (``eval/sampled_reward``). With ``training.eval_trainer_weights``
    the same again on the trainer's unquantized weights (``eval_trainer/*``), after which the
    rollout's copy (``version``) is pushed back, by ``restore`` when given (the served weights may
    lag the policy's: :mod:`megatron_acrl.served_weights`). Every rank calls this (the pushes are
    collective); rank 0 evaluates, the others get {}."""
    m = _evaluate_served(ctx, "eval")
    if ctx.cfg.training.eval_trainer_weights:
        if ctx.cfg.rollout.quantization == "none":  # the served weights are the trainer's
            m.update({"eval_trainer/" + k.split("/", 1)[1]: v for k, v in m.items()})
        else:
            ctx.push_weights(f"{version}+unquantized", quantize=False)
            m.update(_evaluate_served(ctx, "eval_trainer"))
            restore() if restore is not None else ctx.push_weights(version)
    return m


def _evaluate_served(ctx: RunContext, prefix: str) -> dict[str, float]:
    """Rank 0: ``<prefix>/accuracy``, ``<prefix>/response_length`` and ``<prefix>/sampled_reward`` of
    whatever the servers hold now."""
    servers = ctx.servers
    if ctx.rank != 0 or servers is None:
        return {}
    cfg, m = ctx.cfg, {}

    def scored(prompts: list[Prompt], n: int, params: Any) -> RolloutBatch:
        ids = encode_prompts(ctx.tokenizer, prompts, cfg.rollout.max_prompt_len)
        groups = servers.generate(ids, n, params)
        return score_groups(
            ctx.task, ctx.tokenizer, prompts, ids, groups, pad_id=ctx.pad_id, eos_id=ctx.eos_id
        )

    if prompts := ctx.task.eval_prompts(cfg.task.eval_size):
        b = scored(prompts, 1, servers.sampling_params(greedy=True))
        m[f"{prefix}/accuracy"] = float(b.rewards.mean())
        m[f"{prefix}/response_length"] = float(b.response_len.float().mean())
    if cfg.training.eval_samples:
        prompts = fixed_train_prompts(ctx.task, cfg.task.eval_size)
        b = scored(prompts, cfg.training.eval_samples, servers.sampling_params())
        m[f"{prefix}/sampled_reward"] = float(b.rewards.mean())
    return m


def fixed_train_prompts(task: Task, n: int) -> list[Prompt]:
    """The first ``n`` distinct training prompts of a fixed order (the task's seed-0 stream), the same
    at every eval and in every run."""
    seen: dict[int, Prompt] = {}
    for p in itertools.islice(task.train_prompts(seed=0), 4 * n):
        seen.setdefault(p.uid, p)
        if len(seen) == n:
            break
    return list(seen.values())
