"""Partial metrics of the training-inference mismatch and of the correction weights.

Every function here reads one micro-batch's :class:`~megatron_acrl.correction.mismatch.MismatchTensors`
(log pi_old, log mu and the response mask, ``[B, T]``) or its weights, and returns *partial* metrics:
values that combine over micro-batches and data-parallel ranks by a reduction named by the key's
suffix:

- ``*_max``: MAX, ``*_min``: MIN,
- ``*_lse``: log-sum-exp (``torch.logaddexp``), for quantities that overflow in linear space,
- everything else: SUM. Means are already divided by the *global* denominators passed in
  (``num_tokens``: valid tokens of the whole batch, ``num_seqs``: sequences with at least one valid
  token), so the sum of the parts is the metric of the whole batch, exactly.

:func:`combine_partials` combines micro-batches on one rank; the all-reduce over ranks is a collective
and lives on the Megatron side (``megatron_acrl.megatron.collectives.all_reduce_partials``).
:func:`finalize_metrics` turns reduced partials into final floats (one host sync) and derives the
non-additive metrics (std, effective sample size, chi2_seq).

Names follow verl's ``rollout_corr/*`` vocabulary under the prefix ``mismatch/``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_acrl.correction import fused_cpu
from megatron_acrl.correction.mismatch import LOG_RATIO_BOUND, MismatchTensors, cached_const


def reduce_kind(name: str) -> str:
    """How partial metric ``name`` combines across micro-batches / ranks: sum, max, min or lse."""
    for suffix in ("max", "min", "lse"):
        if name.endswith("_" + suffix):
            return suffix
    return "sum"


def combine_partials(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Combine partial metric dicts of several micro-batches (same keys or subsets)."""
    out: dict[str, Tensor] = {}
    for part in parts:
        for k, v in part.items():
            if k not in out:
                out[k] = v.detach().clone()
                continue
            kind = reduce_kind(k)
            if kind == "sum":
                out[k] = out[k] + v.detach()
            elif kind == "max":
                out[k] = torch.maximum(out[k], v.detach())
            elif kind == "min":
                out[k] = torch.minimum(out[k], v.detach())
            else:
                out[k] = torch.logaddexp(out[k], v.detach())
    return out


def _denominator(n: int | Tensor, like: Tensor) -> Tensor | float:
    """1 / max(n, 1), as a Python float when ``n`` is a Python int (saves a device op)."""
    if isinstance(n, Tensor):
        return 1.0 / n.to(like.dtype).clamp_min(1)
    return 1.0 / max(float(n), 1.0)


# Partial names of mismatch_metrics' flat result, in order; None marks a by-product that is dropped.
_MISMATCH_NAMES = (
    # token means of rows neg_log_ratio .. rho_sq_m1
    "kl", None, "prob_abs_diff", "logprob_abs_diff", "k3_kl", "chi2_token",
    # sequence means
    "training_ppl", "rollout_ppl", "ppl_ratio", "log_ppl_diff", "log_ppl_abs_diff",
    "chi2_seq_lse",
    # extremes: max(-log rho), max log rho, max |dp|, max |log rho|, min log rho
    None, "log_ratio_max", "prob_abs_diff_max", "logprob_abs_diff_max", "log_ratio_min",
)  # fmt: skip


def mismatch_metrics(
    sh: MismatchTensors,
    *,
    num_tokens: int | Tensor,
    num_seqs: int | Tensor,
    prefix: str = "mismatch/",
) -> dict[str, Tensor]:
    """Partial mismatch metrics between the trainer's pi_old and the rollout engine's mu.

    Args:
        sh: the micro-batch's shared intermediates (log pi_old, log mu, mask, all ``[B, T]``).
        num_tokens: global number of valid tokens (all micro-batches and ranks).
        num_seqs: global number of sequences with at least one valid token.
    Returns:
        Partial metrics (see module doc), keys prefixed with ``prefix``; with rho = pi_old / mu:
        ``kl`` (k1 = E[log mu - log pi_old]), ``k3_kl`` (E[rho - 1 - log rho]), ``chi2_token``
        (E[rho^2] - 1), ``chi2_seq_lse`` (log E[(prod rho)^2]; final ``chi2_seq``), ``training_ppl``,
        ``rollout_ppl``, ``log_ppl_diff``, ``log_ppl_abs_diff``, ``ppl_ratio`` (sequence means),
        ``logprob_abs_diff``, ``prob_abs_diff`` (token means), ``logprob_abs_diff_max``,
        ``prob_abs_diff_max``, ``log_ratio_max``/``log_ratio_min``.
    """
    if sh.fused:
        values = fused_cpu.mismatch_partials(sh.seq_sums, sh.extremes, num_tokens, num_seqs)
        return {
            prefix + k: v for k, v in zip(_MISMATCH_NAMES, values.unbind(0), strict=True) if k is not None
        }
    ss = sh.seq_sums
    f64, dev = ss.dtype, ss.device
    tok = ss[2:8].sum(-1) * _denominator(num_tokens, ss)
    # Per sequence: mean log pi_old, mean log mu, mean log(mu / pi_old) = log ppl_train - log ppl_rollout.
    means = ss[:3] / sh.lens_c
    # exp(-mean log pi_old), exp(-mean log mu): the perplexities; exp(log ppl diff), saturated like rho.
    bound = LOG_RATIO_BOUND
    ppl = torch.exp(
        torch.clamp(
            means * cached_const(((-1.0,), (-1.0,), (1.0,)), f64, dev),
            cached_const(((-math.inf,), (-math.inf,), (-bound,)), f64, dev),
            cached_const(((math.inf,), (math.inf,), (bound,)), f64, dev),
        )
    )
    seq_rows = torch.cat([ppl, means[2:], means[2:].abs()])  # [5, B]; empty sequences drop out below
    seq = torch.mv(seq_rows, sh.valid_f) * _denominator(num_seqs, ss)
    # chi2_seq: log E[(prod rho)^2] = logsumexp_i(2 * sum_t log rho) - log(num_seqs); no overflow.
    two_s = torch.log(sh.valid_f).add_(ss[3], alpha=2.0)  # -inf for empty sequences
    chi2_lse = torch.logsumexp(two_s, dim=0, keepdim=True) - _log_count(num_seqs, ss)
    ext = sh.extremes  # max(-log rho) = -min(log rho), max log rho, max |dp|
    ext = torch.cat([ext, ext[:2].amax(0, keepdim=True), -ext[:1]])
    values = torch.cat([tok, seq, chi2_lse, ext])
    return {prefix + k: v for k, v in zip(_MISMATCH_NAMES, values.unbind(0), strict=True) if k is not None}


def _log_count(n: int | Tensor, like: Tensor) -> Tensor | float:
    if isinstance(n, Tensor):
        return torch.log(n.to(like.dtype).clamp_min(1))
    return math.log(max(float(n), 1.0))


def row_sums(
    token_rows: dict[str, Tensor],
    seq_rows: dict[str, Tensor],
    *,
    num_tokens: int | Tensor,
    num_seqs: int | Tensor,
) -> dict[str, Tensor]:
    """Partial means of several ``[B, T]`` token rows and ``[B]`` sequence rows, one reduction each.

    Rows may be bool (fractions) or float and must be 0 on padding / empty sequences.
    """
    out: dict[str, Tensor] = {}
    for rows, dims, n in ((token_rows, (1, 2), num_tokens), (seq_rows, (1,), num_seqs)):
        if rows:
            stacked = torch.stack(list(rows.values()))
            # float64: the std of the weights is sqrt(E[w^2] - E[w]^2), a difference of two sums.
            sums = stacked.sum(dims, dtype=torch.float64)
            sums = sums * _denominator(n, sums)
            out.update(zip(rows, sums.unbind(0), strict=True))
    return out


def weight_metrics(
    weights: Tensor,
    mask: Tensor,
    *,
    num_tokens: int | Tensor,
    prefix: str = "correction/",
    extra_token_rows: dict[str, Tensor] | None = None,
    pad: Tensor | None = None,
) -> dict[str, Tensor]:
    """Partial statistics of per-token correction weights over valid tokens.

    Args:
        weights: ``[B, T]`` detached, finite, non-negative correction weights (0 on padding and
            where a token/sequence is masked out).
        mask: ``[B, T]`` response mask.
        num_tokens: global number of valid tokens.
        extra_token_rows: further ``[B, T]`` rows averaged in the same reduction (full key names).
        pad: ``[B, T]`` 0 on valid tokens, -inf on padding (:attr:`MismatchTensors.pad`); derived
            from ``mask`` when None.
    Returns:
        ``weight_mean``, ``weight_sq_mean`` (sum-reduced; std and ``ess`` are derived in
        :func:`finalize_metrics`), ``weight_max``, ``weight_min``.
    """
    w = weights.detach()
    if pad is None:
        m = mask if mask.dtype == torch.bool else mask.bool()
        pad = torch.where(m, cached_const(0.0, w.dtype, w.device), cached_const(-math.inf, w.dtype, w.device))
    rows = {prefix + "weight_mean": w, prefix + "weight_sq_mean": w * w, **(extra_token_rows or {})}
    out = row_sums(rows, {}, num_tokens=num_tokens, num_seqs=1)
    if w.numel() == 0:  # an empty micro-batch: max/min of nothing, without reducing an empty tensor
        ext = cached_const((-math.inf, math.inf), w.dtype, w.device)
    else:
        ext = torch.stack([(w + pad).amax(), (w - pad).amin()])
    out[prefix + "weight_max"], out[prefix + "weight_min"] = ext.unbind(0)
    return out


def _to_floats(values: list[Tensor]) -> list[float]:
    """Scalars -> floats with one device->host copy and few device ops.

    Most partials are views into a few flat tensors (``unbind`` of one stacked result); those bases
    are copied once each instead of stacking dozens of scalars (each stack input is a dispatch).
    On CPU there is no device to synchronise with and reading each scalar is cheapest.
    """
    if all(v.device.type == "cpu" for v in values):
        return [v.item() for v in values]
    sources: list[Tensor] = []
    where: dict[int, int] = {}  # id(source) -> index into sources
    place: list[tuple[int, int]] = []  # (source index, element offset) per value
    for v in values:
        base = v._base
        if base is not None and base.dim() == 1 and v.dim() == 0 and base.stride(0) == 1:
            src, off = base, v.storage_offset() - base.storage_offset()
        else:
            src, off = v.detach().reshape(1), 0
        i = where.setdefault(id(src), len(sources))
        if i == len(sources):
            sources.append(src)
        place.append((i, off))
    offsets = [0]
    for s in sources:
        offsets.append(offsets[-1] + s.numel())
    flat = (torch.cat(sources) if len(sources) > 1 else sources[0]).double().tolist()
    return [flat[offsets[i] + off] for i, off in place]


def finalize_metrics(partials: dict[str, Tensor]) -> dict[str, float]:
    """Reduced partials -> final metrics as Python floats, with one host synchronisation.

    Derives, where their inputs are present: ``*chi2_seq`` from ``*chi2_seq_lse``,
    ``*weight_std`` and ``*ess`` (effective sample size per token, ``E[w]^2 / E[w^2]`` in (0, 1])
    from ``*weight_mean``/``*weight_sq_mean``. Infinite max/min of empty batches become nan.
    """
    keys = list(partials)
    if not keys:
        return {}
    out = dict(zip(keys, _to_floats([partials[k] for k in keys]), strict=True))
    for k in keys:
        if k.endswith("chi2_seq_lse"):
            lse = out.pop(k)
            out[k[: -len("_lse")]] = math.exp(lse) - 1.0 if lse < 700 else math.inf
        elif math.isinf(out[k]) and reduce_kind(k) in ("max", "min"):
            out[k] = math.nan
    for k in [k for k in out if k.endswith("weight_mean")]:
        base = k[: -len("weight_mean")]
        sq = out.get(base + "weight_sq_mean")
        if sq is None:
            continue
        mean = out[k]
        out[base + "weight_std"] = math.sqrt(max(sq - mean * mean, 0.0))
        out[base + "ess"] = mean * mean / sq if sq > 0 else math.nan
    return out
