"""Fused per-token log-probs (and entropy) straight from vocab-parallel logits.

Each TP rank holds logits for a contiguous vocab slice ``[vocab_start, vocab_start + V_local)``. For
every token, with ``x = logits / temperature`` in float32:

    l_r    = logsumexp_{v in shard r} x_v    local, one fused kernel
    M      = max_r l_r                       all-reduce MAX over TP (the global max, shifted)
    lse    = M + log sum_r exp(l_r - M)      all-reduce SUM
    x_tgt  = x[target]                       owning shard contributes, others 0 -> SUM
    logp   = x_tgt - lse
    H      = lse - sum_v p_v x_v             (entropy; each shard's sum is relative to l_r and
                                              rescaled by exp(l_r - M) inside the same SUM)

All SUM reductions travel in one all-reduce, after the one MAX. Work is chunked over tokens so the only float32
copy of logits that exists is ``chunk_size x V_local``; backward recomputes ``p`` chunk by chunk from
the saved ``m + log Z`` (no collective in backward):

    d logp / d x_v = 1[v = target] - p_v          d H / d x_v = p_v (E_p[x] - x_v)

Temperature is applied as SGLang does: float32 logits divided by the temperature before the softmax.
Vocab rows that only exist for TP padding (global id >= ``vocab_size``) are excluded, so the
distribution is the HF/SGLang one over the real vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_logprobs"]


def _valid_columns(v_local: int, vocab_start: int, vocab_size: int | None) -> int:
    if vocab_size is None:
        return v_local
    return max(0, min(v_local, vocab_size - vocab_start))


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: dist.ProcessGroup | None,
        vocab_start: int,
        vocab_size: int | None,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_tok, v_local = logits.shape
        n_valid = _valid_columns(v_local, vocab_start, vocab_size)
        distributed = tp_group is not None and dist.get_world_size(tp_group) > 1
        f32 = dict(dtype=torch.float32, device=logits.device)
        lse = torch.empty(n_tok, **f32)
        entropy = torch.zeros(n_tok, **f32)
        local_tgt = target - vocab_start
        owned = (local_tgt >= 0) & (local_tgt < n_valid)
        local_tgt = torch.where(owned, local_tgt, torch.zeros_like(local_tgt))
        # Target logit straight from the (bf16) shard: only the owning rank contributes.
        tgt = torch.zeros(n_tok, **f32)
        if n_valid:
            tgt = logits.gather(-1, local_tgt[:, None]).squeeze(-1).float().div_(temperature)
            tgt = torch.where(owned, tgt, torch.zeros_like(tgt))
        for lo in range(0, n_tok, chunk_size):
            hi = min(lo + chunk_size, n_tok)
            if n_valid:
                # float32 copy of this chunk only (never of the whole shard; never in place on logits)
                x = logits[lo:hi, :n_valid].to(torch.float32, copy=True)
                if temperature != 1.0:
                    x.div_(temperature)  # as SGLang: float32 logits divided by the temperature
                local_lse = torch.logsumexp(x, dim=-1)  # one fused pass, no exp tensor kept
            else:  # this rank only holds TP padding rows
                x = None
                local_lse = torch.full((hi - lo,), float("-inf"), **f32)
            if with_entropy:
                # B_r = sum_{v in r} exp(x_v - l_r) (x_v - l_r): shifted by the local lse, so no
                # cancellation between large logits and lse (minus the shard's own entropy).
                if x is not None:
                    y = x.sub_(local_lse[:, None])
                    b = (torch.exp(y) * y).sum(-1)
                else:
                    b = torch.zeros_like(local_lse)
            del x
            if distributed:
                # lse = M + log sum_r exp(l_r - M): one MAX, then one SUM for everything else.
                peak = local_lse.clone()
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp_group)
                w = torch.exp(local_lse - peak)
                parts = [w, tgt[lo:hi]]
                if with_entropy:  # sum_r w_r (B_r + l_r - M); w_r = 0 on padding-only ranks
                    parts.append(torch.nan_to_num(w * (b + local_lse - peak), nan=0.0))
                stacked = torch.stack(parts)
                dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
                log_s = stacked[0].log()
                lse[lo:hi] = peak + log_s
                tgt[lo:hi] = stacked[1]
                if with_entropy:  # H = (lse - M) - sum_r w_r (B_r + l_r - M) / s
                    entropy[lo:hi] = log_s - stacked[2] / stacked[0]
            else:
                lse[lo:hi] = local_lse
                if with_entropy:
                    entropy[lo:hi] = -b
        logp = tgt - lse
        ctx.save_for_backward(logits, local_tgt, owned, lse, entropy)
        ctx.params = (n_valid, temperature, chunk_size, with_entropy)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None):  # type: ignore[override]
        logits, local_tgt, owned, lse, entropy = ctx.saved_tensors
        n_valid, temperature, chunk_size, with_entropy = ctx.params
        n_tok, v_local = logits.shape
        grad = torch.empty_like(logits)
        if n_valid < v_local:
            grad[:, n_valid:] = 0  # TP padding rows get no gradient
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        use_h = with_entropy and grad_entropy is not None
        inv_t = 1.0 / temperature
        for lo in range(0, n_tok, chunk_size):
            hi = min(lo + chunk_size, n_tok)
            if not n_valid:
                break
            chunk = logits[lo:hi, :n_valid]
            g_lp = grad_logp[lo:hi, None]
            if temperature != 1.0 or use_h:
                # y = x / T - lse (float32 chunk); p = exp(y)
                y = chunk.to(torch.float32, copy=True)
                if temperature != 1.0:
                    y.div_(temperature)
                y.sub_(lse[lo:hi, None])
                p = torch.exp(y)
            else:  # the op reads the shard once and promotes to float32
                y = None
                p = torch.sub(chunk, lse[lo:hi, None]).exp_()
            if use_h:
                # d/dx = g_lp (onehot - p) + g_h p (E[x] - x), and E[x] - x = -(H + y)
                coef = y.add_(entropy[lo:hi, None]).mul_(-grad_entropy[lo:hi, None]).sub_(g_lp)
                g = p.mul_(coef)
            else:
                g = p.mul_(-g_lp)
            del y
            sel = owned[lo:hi]
            rows = torch.arange(hi - lo, device=g.device)[sel]
            g[rows, local_tgt[lo:hi][sel]] += grad_logp[lo:hi][sel]
            if temperature != 1.0:
                g.mul_(inv_t)
            grad[lo:hi, :n_valid].copy_(g)  # cast to the logits dtype on the copy
            del p, g
        if not n_valid:
            grad.zero_()
        return grad, None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``target`` (and optionally the entropy) under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V_local]`` vocab-parallel logits of this TP rank (any float dtype; not copied
            to float32 as a whole). TP rank r holds global vocab ids ``[r * V_local, (r+1) * V_local)``.
        target: ``[...]`` int64 global token ids.
        tp_group: the tensor-parallel group (None or size 1: plain local computation).
        vocab_size: real vocabulary size; logits of ids >= vocab_size (TP padding) are excluded.
        temperature: sampling temperature of the rollout engine.
        chunk_size: tokens processed at once (bounds the float32 working set).
        with_entropy: also return the entropy of the full distribution.

    Returns:
        ``(logprobs [...], entropy [...] or None)``, both float32.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    shape = target.shape
    v_local = logits.shape[-1]
    rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    flat_logits = logits.reshape(-1, v_local)
    flat_target = target.reshape(-1)
    logp, entropy = _VocabParallelLogProb.apply(
        flat_logits, flat_target, tp_group, rank * v_local, vocab_size, float(temperature), chunk_size,
        with_entropy,
    )
    return logp.view(shape), (entropy.view(shape) if with_entropy else None)
