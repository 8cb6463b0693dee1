"""Fused per-token log-probs (and entropy) straight from vocab-parallel logits.

Each TP rank holds logits for a contiguous vocab slice ``[vocab_start, vocab_start + V_local)``. For
every token, with ``x = logits / temperature`` in float32:

    l_r    = logsumexp_{v in shard r} x_v    local, from one fused log_softmax kernel
    M      = max_r l_r                       all-reduce MAX over TP (the global max, shifted)
    lse    = M + log sum_r exp(l_r - M)      all-reduce SUM
    x_tgt  = x[target]                       owning shard contributes, others 0 -> SUM
    logp   = x_tgt - lse
    H      = lse - sum_v p_v x_v             (entropy; each shard's sum is relative to l_r and
                                              rescaled by exp(l_r - M) inside the same SUM)

All SUM reductions travel in one all-reduce, after the one MAX. Work is chunked over tokens, so the
float32 working set is a few ``chunk_size x V_local`` tensors, never a copy of the whole shard.
Backward recomputes ``p`` chunk by chunk (local softmax rescaled by the saved ``exp(l_r - lse)``; no
collective in backward):

    d logp / d x_v = 1[v = target] - p_v          d H / d x_v = p_v (E_p[x] - x_v)

The work uses the fused ``log_softmax`` / ``softmax`` kernels (on CPU much faster than chains of
elementwise exp/sum). With ``inplace_backward`` the gradient overwrites the logits chunk by chunk.

Temperature is applied as SGLang does: float32 logits divided by the temperature before the softmax.
Vocab rows that only exist for TP padding (global id >= ``vocab_size``) are excluded, so the
distribution is the HF/SGLang one over the real vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["auto_chunk_size", "vocab_parallel_logprobs"]


def _scaled_chunk(logits: torch.Tensor, lo: int, hi: int, n_valid: int, temperature: float) -> torch.Tensor:
    """Rows [lo, hi) of the real-vocabulary columns, divided by the temperature in float32 (as SGLang
    does). Without temperature the (bf16) view itself is returned: the fused kernels read it with
    ``dtype=float32``, so no float32 copy is made. Never modifies ``logits``."""
    chunk = logits[lo:hi, :n_valid]
    if temperature == 1.0:
        return chunk
    return chunk.to(torch.float32, copy=True).div_(temperature)


# On CPU each core gets ~1 MiB of float32 chunk: the 3-4 passes over a chunk (cast, softmax, gradient)
# then hit the core's L2 instead of memory, which makes small chunks several times faster than one
# big log_softmax. On GPU launches, not caches, matter: big chunks.
_CPU_CHUNK_BYTES_PER_THREAD = 1 << 20
_GPU_CHUNK_TOKENS = 1024


def auto_chunk_size(v_local: int, device: torch.device) -> int:
    """Tokens per chunk for ``V_local`` vocabulary columns on ``device`` (see the module doc)."""
    if device.type != "cpu":
        return _GPU_CHUNK_TOKENS
    budget = _CPU_CHUNK_BYTES_PER_THREAD * torch.get_num_threads()
    return max(1, budget // (4 * max(v_local, 1)))


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
        inplace_backward: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_tok, v_local = logits.shape
        n_valid = _valid_columns(v_local, vocab_start, vocab_size)
        distributed = tp_group is not None and dist.get_world_size(tp_group) > 1
        f32 = dict(dtype=torch.float32, device=logits.device)
        logp = torch.zeros(n_tok, **f32)
        entropy = torch.zeros(n_tok, **f32)
        shift = torch.zeros(n_tok, **f32)  # l_r - lse: local -> global log-softmax (0 without TP)
        local_tgt = target - vocab_start
        owned = (local_tgt >= 0) & (local_tgt < n_valid)
        local_tgt = torch.where(owned, local_tgt, torch.zeros_like(local_tgt))
        for lo in range(0, n_tok, chunk_size):
            hi = min(lo + chunk_size, n_tok)
            rows = slice(lo, hi)
            # log_softmax / softmax are single fused kernels (much faster than exp/sum chains on
            # CPU). Everything is kept relative to the shard's own lse l_r: no cancellation.
            if n_valid:
                x = _scaled_chunk(logits, lo, hi, n_valid, temperature)
                ls = torch.log_softmax(x, dim=-1, dtype=torch.float32)
                ls_tgt = torch.where(owned[rows], ls.gather(-1, local_tgt[rows, None]).squeeze(-1), 0.0)
                # B_r = sum_v softmax_r(x)_v log_softmax_r(x)_v: minus the shard's own entropy
                b = torch.softmax(x, dim=-1, dtype=torch.float32).mul_(ls).sum(-1) if with_entropy else None
            if not distributed:
                logp[rows] = ls_tgt
                if with_entropy:
                    entropy[rows] = -b
                continue
            if n_valid:  # l_r, read off at each row's max where |x - l_r| is smallest
                ls_max, arg = ls.max(dim=-1, keepdim=True)
                local_lse = (x.gather(-1, arg).float() - ls_max).squeeze(-1)
            else:  # this rank only holds TP padding rows
                local_lse = torch.full((hi - lo,), float("-inf"), **f32)
                ls_tgt = torch.zeros_like(local_lse)
                b = torch.zeros_like(local_lse)
            # lse = M + log sum_r exp(l_r - M): one MAX, then one SUM for everything else.
            peak = local_lse.clone()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp_group)
            w = torch.exp(local_lse - peak)  # 0 on padding-only ranks
            parts = [w, torch.where(owned[rows], ls_tgt + local_lse - peak, 0.0)]
            if with_entropy:  # sum_r w_r (B_r + l_r - M)
                parts.append(torch.nan_to_num(w * (b + local_lse - peak), nan=0.0))
            stacked = torch.stack(parts)
            dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
            log_s = stacked[0].log()  # lse - M
            logp[rows] = stacked[1] - log_s  # x_tgt - lse, from the owning shard
            shift[rows] = local_lse - peak - log_s
            if with_entropy:  # H = (lse - M) - sum_r w_r (B_r + l_r - M) / s
                entropy[rows] = log_s - stacked[2] / stacked[0]
        ctx.save_for_backward(logits, local_tgt, owned, shift, entropy)
        ctx.params = (n_valid, temperature, chunk_size, with_entropy, inplace_backward, distributed)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None):  # type: ignore[override]
        logits, local_tgt, owned, shift, entropy = ctx.saved_tensors
        n_valid, temperature, chunk_size, with_entropy, inplace, distributed = ctx.params
        n_tok, v_local = logits.shape
        # In place: each chunk's gradient overwrites the logits it was computed from (they are not
        # needed afterwards), so backward allocates no logits-sized tensor (as Megatron's own
        # vocab-parallel cross entropy does).
        grad = logits if inplace else torch.empty_like(logits)
        if n_valid < v_local:
            grad[:, n_valid:] = 0  # TP padding rows get no gradient
        if not n_valid:
            return grad, None, None, None, None, None, None, None, None
        if grad_logp is None:
            grad_logp = torch.zeros_like(shift)
        use_h = with_entropy and grad_entropy is not None
        rescale = torch.exp(shift)  # global softmax = local softmax * exp(l_r - lse)
        for lo in range(0, n_tok, chunk_size):
            hi = min(lo + chunk_size, n_tok)
            x = _scaled_chunk(logits, lo, hi, n_valid, temperature)
            p = torch.softmax(x, dim=-1, dtype=torch.float32)
            if distributed:
                p.mul_(rescale[lo:hi, None])
            g_lp = grad_logp[lo:hi, None]
            sel = owned[lo:hi]
            rows = torch.arange(hi - lo, device=p.device)[sel]
            cols = local_tgt[lo:hi][sel]
            if use_h:
                # d/dx = g_lp (onehot - p) + g_h p (E[x] - x), with E[x] - x = -(H + log p)
                y = torch.log_softmax(x, dim=-1, dtype=torch.float32)
                if distributed:
                    y.add_(shift[lo:hi, None])
                coef = y.add_(entropy[lo:hi, None]).mul_(-grad_entropy[lo:hi, None]).sub_(g_lp)
                g = p.mul_(coef)
                del y
                g[rows, cols] += grad_logp[lo:hi][sel]
                if temperature != 1.0:
                    g.div_(temperature)
                grad[lo:hi, :n_valid].copy_(g)  # cast to the logits dtype on the copy
            else:
                # d/dx = -g_lp (p - onehot) / T: one fused multiply that also casts into the gradient
                p[rows, cols] -= 1.0
                torch.mul(p, g_lp * (-1.0 / temperature), out=grad[lo:hi, :n_valid])
            del x, p
        return grad, None, None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``target`` (and optionally the entropy) under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V_local]`` vocab-parallel logits of this TP rank (any float dtype; not copied
            to float32 as a whole). TP rank r holds global vocab ids ``[r * V_local, (r+1) * V_local)``.
        target: ``[...]`` int64 global token ids.
        tp_group: the tensor-parallel group (None or size 1: plain local computation).
        vocab_size: real vocabulary size; logits of ids >= vocab_size (TP padding) are excluded.
        temperature: sampling temperature of the rollout engine.
        chunk_size: tokens processed at once (bounds the float32 working set); None:
            :func:`auto_chunk_size`.
        with_entropy: also return the entropy of the full distribution.
        inplace_backward: write the gradient into ``logits``' storage (no logits-sized allocation in
            backward). Only when nothing else reads ``logits`` after this call and backward runs
            once (true for the loss adapter: Megatron's output layer saves its input, not its output).

    Returns:
        ``(logprobs [...], entropy [...] or None)``, both float32.
    """
    shape = target.shape
    v_local = logits.shape[-1]
    if chunk_size is None:
        chunk_size = auto_chunk_size(v_local, logits.device)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    flat_logits = logits.reshape(-1, v_local)
    flat_target = target.reshape(-1)
    logp, entropy = _VocabParallelLogProb.apply(
        flat_logits,
        flat_target,
        tp_group,
        rank * v_local,
        vocab_size,
        float(temperature),
        chunk_size,
        with_entropy,
        inplace_backward,
    )
    return logp.view(shape), (entropy.view(shape) if with_entropy else None)
