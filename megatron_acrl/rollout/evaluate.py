"""Evaluation of the served policy (and, on request, of the trainer's own unquantized weights), and
the exact metric.

Greedy accuracy on the held-out split, the sampled reward on fixed training prompts; every rank
calls :func:`evaluate` (the weight pushes it makes are collective), rank 0 evaluates. For an agent
run (``rollout.agent``) the same protocol runs whole trajectories through the same agent loop as
training (greedy: every turn at temperature 0), and adds the tool-call rate (:func:`eval_due`: also
at step 0 and at the last step).

The exact metric (:func:`evaluate_exact`, ``training.exact_eval_interval``): for a task whose prompts
can be enumerated (1-digit addition: 100), the expected reward of the canonical answer,
``J = mean over prompts of P(answer tokens + EOS | prompt)``, teacher-forced at temperature 1 --
on the trainer's weights (``eval/exact_j``: one forward pass, :meth:`Policy.sequence_logprobs`) and
on the copy the servers hold (``eval/exact_j_served``: their prompt log-probs of the same tokens,
:meth:`RolloutServers.score`, so FP8 weights, the FP8 KV cache and the weight lag count). J is a lower
bound of the expected sampled reward (other completions may also be right) without its sampling
noise: it moves only when the policy does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_acrl.batch.rollout_batch import RolloutBatch
from megatron_acrl.logging import read_jsonl_metrics
from megatron_acrl.rollout.phase import encode_prompts, score_groups
from megatron_acrl.rollout.trajectories import sample_trajectories
from megatron_acrl.tasks.base import Prompt, Task

if TYPE_CHECKING:
    from megatron_acrl.rollout.backend import RolloutBackend
    from megatron_acrl.run.context import RunContext


def evaluate(
    ctx: RunContext, step: int, version: str, restore: Callable[[], object] | None = None
) -> dict[str, float]:
    """Evaluate the served policy: greedy accuracy and mean response length on the held-out split
    (``eval/accuracy``, ``eval/response_length``) and, with ``training.eval_samples``, the sampled
    reward on fixed training prompts (``eval/sampled_reward``). With ``training.eval_trainer_weights``
    the same again on the trainer's unquantized weights (``eval_trainer/*``), after which the
    rollout's copy (``version``) is pushed back, by ``restore`` when given (the served weights may
    lag the policy's: :mod:`megatron_acrl.servers.publisher`). Every rank calls this (the pushes are
    collective); rank 0 evaluates, the others get {}."""
    m = _evaluate_served(ctx, "eval")
    if ctx.cfg.training.eval_trainer_weights:
        if ctx.cfg.rollout.quantization == "none":  # the served weights are the trainer's
            m.update({"eval_trainer/" + k.split("/", 1)[1]: v for k, v in m.items()})
        else:
            assert ctx.publisher is not None
            ctx.publisher.push(f"{version}+unquantized", quantize=False)
            m.update(_evaluate_served(ctx, "eval_trainer"))
            restore() if restore is not None else ctx.publisher.push(version)
    return m


def _evaluate_served(ctx: RunContext, prefix: str) -> dict[str, float]:
    """Rank 0: ``<prefix>/accuracy``, ``<prefix>/response_length`` and ``<prefix>/sampled_reward`` of
    whatever the servers hold now."""
    if ctx.rank != 0 or ctx.servers is None:
        return {}
    servers: RolloutBackend = ctx.servers
    cfg, m = ctx.cfg, {}

    def scored(prompts: list[Prompt], n: int, params: Any) -> RolloutBatch:
        if is_agent(cfg):  # the same trajectories as training's, through the same agent loop
            return sample_trajectories(ctx, prompts, 0, n=n, params=params)
        ids = encode_prompts(ctx.tokenizer, prompts, cfg.rollout.max_prompt_len)
        groups = servers.generate(ids, n, params)
        return score_groups(
            ctx.task, ctx.tokenizer, prompts, ids, groups, pad_id=ctx.pad_id, eos_id=ctx.eos_id
        )

    if prompts := ctx.task.eval_prompts(cfg.task.eval_size):
        b = scored(prompts, 1, servers.sampling_params(greedy=True))
        m[f"{prefix}/accuracy"] = float(b.rewards.mean())
        m[f"{prefix}/response_length"] = float(b.response_len.float().mean())
        m.update(_agent_rates(b, prefix))
    if cfg.training.eval_samples:
        prompts = fixed_train_prompts(ctx.task, cfg.task.eval_size)
        b = scored(prompts, cfg.training.eval_samples, servers.sampling_params())
        m[f"{prefix}/sampled_reward"] = float(b.rewards.mean())
        m.update({k + "_sampled": v for k, v in _agent_rates(b, prefix).items()})
    return m


def is_agent(cfg: Any) -> bool:
    """Whether the run's rollouts are agent trajectories (``rollout.agent.agent`` or ``.env`` set)."""
    return cfg.rollout.agent.agent is not None or cfg.rollout.agent.env is not None


def _agent_rates(b: RolloutBatch, prefix: str) -> dict[str, float]:
    """An agent evaluation's ``<prefix>/tool_call_rate`` (calls per trajectory), ``<prefix>/
    answered_frac`` (trajectories that ended with an answer) and ``<prefix>/turns_mean``; {} for
    single-turn batches."""
    rows = b.agent_rows
    if not rows:
        return {}
    k = len(rows)
    return {
        f"{prefix}/tool_call_rate": sum(r["tool_calls"] for r in rows) / k,
        f"{prefix}/answered_frac": b.finish_reasons.count("answered") / k,
        f"{prefix}/turns_mean": sum(r["turns"] for r in rows) / k,
    }


def eval_due(cfg: Any, step: int) -> bool:
    """Whether :func:`evaluate` runs after ``step`` RL steps: every ``training.eval_interval`` steps;
    for an agent run also at 0 (the warm-started policy) and at the last step, so its rise is
    measured over the whole run. (A single-turn run's step 0 is the exact metric's; its evals stay
    where they were.)"""
    every = cfg.training.eval_interval
    if not every:
        return False
    if not is_agent(cfg):
        return step > 0 and step % every == 0
    return step % every == 0 or step == cfg.training.num_steps


def fixed_train_prompts(task: Task, n: int) -> list[Prompt]:
    """The first ``n`` distinct training prompts of a fixed order (the task's seed-0 stream), the same
    at every eval and in every run."""
    seen: dict[int, Prompt] = {}
    for p in itertools.islice(task.train_prompts(seed=0), 4 * n):
        seen.setdefault(p.uid, p)
        if len(seen) == n:
            break
    return list(seen.values())


# -- the exact metric -------------------------------------------------------------------------------


def exact_due(cfg: Any, step: int) -> bool:
    """Whether the exact metric runs after ``step`` RL steps: at 0 (the weights that sample step 1),
    every ``training.exact_eval_interval`` steps and at the last step."""
    every = cfg.training.exact_eval_interval
    return bool(every) and (step % every == 0 or step == cfg.training.num_steps)


def exact_sequences(
    tokenizer: Any, prompts: Sequence[Prompt], eos_id: int
) -> tuple[list[list[int]], list[int]]:
    """Each prompt's token ids followed by its reference answer's and EOS (tokenized apart, as the
    rollout and the warm start see them), and the number of answer tokens + 1 (the EOS)."""
    seqs, lens = [], []
    for p in prompts:
        answer = tokenizer.encode(p.answer, add_special_tokens=False) + [eos_id]
        seqs.append(tokenizer.encode(p.text, add_special_tokens=False) + answer)
        lens.append(len(answer))
    return seqs, lens


def exact_batch(
    seqs: Sequence[Sequence[int]], lens: Sequence[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens [N, L]`` int64 right-padded with ``pad_id`` and ``loss_mask [N, L]`` float32, 1 on each
    sequence's last ``lens[i]`` tokens (the answer and EOS)."""
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width)
    for i, (s, k) in enumerate(zip(seqs, lens, strict=True)):
        tokens[i, : len(s)] = torch.tensor(s)
        mask[i, len(s) - k : len(s)] = 1.0
    return tokens, mask


def exact_j(seq_logprobs: Sequence[float] | torch.Tensor) -> float:
    """J = mean over prompts of exp(log P(answer + EOS | prompt))."""
    lp = torch.as_tensor(seq_logprobs, dtype=torch.float64)
    return float(lp.exp().mean())


def evaluate_exact(ctx: RunContext, step: int) -> dict[str, float]:
    """The exact metric after ``step`` steps when :func:`exact_due` (else {}): ``eval/exact_j`` on
    every rank (the forward pass is collective, every rank calls this), and on rank 0 with servers
    ``eval/exact_j_served`` and ``eval/exact_j_gap`` (served minus trainer)."""
    if not exact_due(ctx.cfg, step):
        return {}
    prompts = ctx.task.exact_prompts()  # type: ignore[attr-defined]  # checked by the config
    seqs, lens = exact_sequences(ctx.tokenizer, prompts, ctx.eos_id)
    tokens, mask = exact_batch(seqs, lens, ctx.pad_id)
    m = {"eval/exact_j": exact_j(ctx.policy.sequence_logprobs(tokens, mask))}
    if ctx.rank == 0 and ctx.servers is not None:
        served = [sum(x) for x in ctx.servers.score(seqs, lens)]
        m["eval/exact_j_served"] = exact_j(served)
        m["eval/exact_j_gap"] = m["eval/exact_j_served"] - m["eval/exact_j"]
    return m


def exact_j_summary(run_dir: str | Path) -> str | None:
    """``exact J (...): trainer 0.31 -> 0.58 (+0.27), served ...`` from a run's ``metrics.jsonl``, at
    its first and last exact eval, beside the sampled reward of the steps those weights sampled;
    None when the run logged no exact metric."""
    rows = read_jsonl_metrics(Path(run_dir) / "metrics.jsonl")
    evals = [r for r in rows if _finite(r.get("eval/exact_j"))]
    if len(evals) < 2:
        return None
    first, last = evals[0], evals[-1]
    parts = [
        f"trainer {first['eval/exact_j']:.3f} -> {last['eval/exact_j']:.3f} "
        f"({last['eval/exact_j'] - first['eval/exact_j']:+.3f})"
    ]
    if _finite(first.get("eval/exact_j_served")) and _finite(last.get("eval/exact_j_served")):
        a, b = first["eval/exact_j_served"], last["eval/exact_j_served"]
        parts.append(f"served {a:.3f} -> {b:.3f} ({b - a:+.3f})")
    # The rollout of step s + 1 was sampled from the weights after step s.
    reward = {int(r["step"]): r["reward/mean"] for r in rows if _finite(r.get("reward/mean"))}
    r0, r1 = reward.get(int(first["step"]) + 1), reward.get(int(last["step"]))
    if r0 is not None and r1 is not None:
        parts.append(f"sampled reward {r0:.3f} -> {r1:.3f}")
    return f"exact J (teacher-forced, step {first['step']} -> {last['step']}): " + ", ".join(parts)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(float(x))
