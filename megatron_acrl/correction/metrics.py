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

_KINDS = frozenset(("max", "min", "lse"))


def reduce_kind(name: str) -> str:
    """How partial metric ``name`` combines across micro-batches / ranks: sum, max, min or lse."""
    _, sep, suffix = name.rpartition("_")
    return suffix if sep and suffix in _KINDS else "sum"


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
    # token means of rows neg_log_ratio .. rho_sq_m1, then the count of non-finite tokens dropped
    "kl", None, "prob_abs_diff", "logprob_abs_diff", "k3_kl", "chi2_token", "nonfinite_tokens",
    # sequence means (the *_log_ppl are verl's names: mean over sequences of -mean_t log p)
    "training_ppl", "rollout_ppl", "ppl_ratio", "training_log_ppl", "rollout_log_ppl", "log_ppl_diff",
    "log_ppl_abs_diff", "chi2_seq_lse",
    # maxima: of -log rho, log rho, |dp| over tokens, of +-mean log(mu / pi_old) over sequences
    None, "log_ratio_max", "prob_abs_diff_max", "log_ppl_diff_max", None,
    # derived: max |log rho|, min log rho, min mean log(mu / pi_old)
    "logprob_abs_diff_max", "log_ratio_min", "log_ppl_diff_min",
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
        Partial metrics (see module doc), keys prefixed with ``prefix``; with rho = pi_old / mu and
        d_i = mean_t log(mu / pi_old) of sequence i: ``kl`` (k1 = E[log mu - log pi_old]), ``k3_kl``
        (E[rho - 1 - log rho]), ``chi2_token`` (E[rho^2] - 1), ``chi2_seq_lse`` (log E[(prod rho)^2];
        final ``chi2_seq``), ``training_ppl``, ``rollout_ppl`` (E_seq[exp(-mean_t log p)]),
        ``training_log_ppl``, ``rollout_log_ppl`` (E_seq[-mean_t log p]), ``log_ppl_diff``,
        ``log_ppl_abs_diff``, ``ppl_ratio`` (E_seq of d_i, |d_i|, exp d_i), ``log_ppl_diff_max`` /
        ``_min`` (over sequences), ``logprob_abs_diff``, ``prob_abs_diff`` (token means),
        ``logprob_abs_diff_max``, ``prob_abs_diff_max``, ``log_ratio_max`` / ``_min`` (over tokens)
        and ``nonfinite_tokens`` (masked-in tokens dropped for a NaN/Inf log-prob; a count).
    """
    if sh.fused:
        values = fused_cpu.mismatch_partials(sh.seq_sums, sh.extremes, num_tokens, num_seqs)
    else:
        values = _mismatch_partials(sh, num_tokens, num_seqs)
    return {prefix + k: v for k, v in zip(_MISMATCH_NAMES, values.unbind(0), strict=True) if k is not None}


def _mismatch_partials(sh: MismatchTensors, num_tokens: int | Tensor, num_seqs: int | Tensor) -> Tensor:
    """The PyTorch path of :func:`mismatch_metrics`: ``[len(_MISMATCH_NAMES)]`` float64, in order."""
    ss = sh.seq_sums
    f64, dev = ss.dtype, ss.device
    sums = ss[2:].sum(-1)  # rows 2..9 over sequences in one reduction: token rows, mask, non-finite
    tok, bad = sums[:6] * _denominator(num_tokens, ss), sums[7:]
    # Per sequence: -mean log pi_old, -mean log mu (the log perplexities), d = mean log(mu / pi_old).
    nm = sh.seq_means[:3] * cached_const(((-1.0,), (-1.0,), (1.0,)), f64, dev)
    bound = LOG_RATIO_BOUND  # exp(d) is saturated like rho
    ppl = torch.exp(
        nm.clamp(
            cached_const(((-math.inf,), (-math.inf,), (-bound,)), f64, dev),
            cached_const(((math.inf,), (math.inf,), (bound,)), f64, dev),
        )
    )
    seq_rows = torch.cat([ppl, nm, nm[2:].abs()])  # [7, B]; empty sequences drop out below
    seq = torch.mv(seq_rows, sh.valid_f) * _denominator(num_seqs, ss)
    seq_pad = torch.log(sh.valid_f)  # 0 for sequences with a valid token, -inf for the others
    # chi2_seq: log E[(prod rho)^2] = logsumexp_i(2 * sum_t log rho) - log(num_seqs); no overflow.
    chi2_lse = torch.logsumexp(torch.add(seq_pad, ss[3], alpha=2.0), 0, keepdim=True)
    chi2_lse = chi2_lse - _log_count(num_seqs, ss)
    if ss.shape[1] == 0:  # no sequence: maxima of nothing
        peaks = cached_const((-math.inf,) * 5, f64, dev)
    else:  # token maxima per sequence, then +-d over sequences: one reduction
        pm = nm[2:] * cached_const(((1.0,), (-1.0,)), f64, dev) + seq_pad
        peaks = torch.cat([sh.seq_max, pm]).amax(-1)
    return torch.cat([tok, bad, seq, chi2_lse, peaks, peaks[:2].amax(0, keepdim=True), -peaks[0::4]])


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
    mask_f: Tensor | None = None,
) -> dict[str, Tensor]:
    """Partial statistics of per-token correction weights over valid tokens.

    Args:
        weights: ``[B, T]`` detached, finite, non-negative correction weights (0 on padding and
            where a token/sequence is masked out); squared in float64.
        mask: ``[B, T]`` response mask.
        num_tokens: global number of valid tokens.
        extra_token_rows: further ``[B, T]`` rows averaged in the same reduction (full key names).
        pad: ``[B, T]`` 0 on valid tokens, -inf on padding (:attr:`MismatchTensors.pad`); derived
            from ``mask`` when None; mask_f: ``mask`` as a float64 row (:attr:`MismatchTensors.mask_f`),
            likewise.
    Returns:
        ``weight_mean``, ``weight_dev_sq_mean`` (``E[(w - 1)^2]``, sum-reduced), ``weight_sq_lse``
        (``log E[w^2]``, lse-reduced: scale-free, :func:`sq_mean_lse`; the std, ``E[w^2]`` and
        ``ess`` are derived in :func:`finalize_metrics`), ``weight_max``, ``weight_min``.
    """
    extra = extra_token_rows or {}
    w = weights.detach()
    rows = torch.empty((2 + len(extra), *w.shape), dtype=torch.float64, device=w.device)
    rows[0].copy_(w)
    for i, row in enumerate(extra.values()):
        rows[2 + i].copy_(row)
    if mask_f is None or pad is None:
        m = mask if mask.dtype == torch.bool else mask.bool()
        mask_f = m.to(torch.float64)
        pad = torch.where(
            m, cached_const(0.0, torch.float64, w.device), cached_const(-math.inf, torch.float64, w.device)
        )
    return token_row_metrics(rows, tuple(extra), num_tokens=num_tokens, mask_f=mask_f, pad=pad, prefix=prefix)


def token_row_metrics(
    rows: Tensor,
    names: tuple[str, ...],
    *,
    num_tokens: int | Tensor,
    mask_f: Tensor,
    pad: Tensor,
    prefix: str = "correction/",
) -> dict[str, Tensor]:
    """:func:`weight_metrics` of weights already laid out with their extra rows in one buffer.

    A method that writes its weights and rows into one buffer (``acrl``) spares the copies and
    the stack: the whole set is one reduction.

    Args:
        rows: ``[2 + K, B, T]`` float64: row 0 the weights (0 off the valid tokens), row 1 scratch
            (overwritten with ``(w - 1)^2``), rows 2.. the extra token rows named by ``names``
            (0 off the valid tokens).
        mask_f: ``[B, T]`` float64, 1 on the valid tokens; pad: ``[B, T]``, 0 on them, -inf elsewhere.
    Returns:
        As :func:`weight_metrics`.
    """
    w = rows[0]
    # The std is sqrt(E[(w - 1)^2] - (E[w] - 1)^2): weights live near 1, and about 1 that difference
    # of two sums loses nothing (E[w^2] - E[w]^2 loses 7 digits of a std of 3e-5, even in float64).
    torch.sub(w, mask_f, out=rows[1]).square_()  # w - 1 on valid tokens, else 0
    sums = rows.sum((1, 2))
    sums = sums * _denominator(num_tokens, sums)
    keys = (prefix + "weight_mean", prefix + "weight_dev_sq_mean", *names)
    out = dict(zip(keys, sums.unbind(0), strict=True))
    if w.numel() == 0:  # an empty micro-batch: max/min of nothing, without reducing an empty tensor
        w_max, w_min = cached_const((-math.inf, math.inf), w.dtype, w.device).unbind(0)
    else:  # two scalars as they come (a stack and an unbind would be two more calls)
        w_max, w_min = (w + pad).amax(), (w - pad).amin()
    out[prefix + "weight_max"], out[prefix + "weight_min"] = w_max, w_min
    out[prefix + "weight_sq_lse"] = sq_mean_lse(w, w_max, num_tokens)
    return out


def sq_mean_lse(weights: Tensor, w_max: Tensor, num_tokens: int | Tensor) -> Tensor:
    """``log(sum w^2 / num_tokens)``, the lse-reduced partial of ``E[w^2]`` that the effective sample
    size reads, at any scale of the weights.

    ``E[w^2]`` cannot come from ``E[(w - 1)^2] + 2 E[w] - 1``: for weights far below 1 the three terms
    are about 1 and cancel (at w ~ 1e-8, every digit of E[w^2] ~ 1e-16 is lost and the ess read NaN).
    The squares are summed in float64: those of float32 (or narrower) weights never leave its range
    (1e-45^2 and 3e38^2 are inside it), one pass; float64 weights are first divided by the
    micro-batch's largest weight (each then at most 1, the largest exactly 1: no square under- or
    overflows beyond 1e+-154) and the scale goes back in log space, ``log sum (w / M)^2 + 2 log M``.

    Args:
        weights: ``[B, T]`` non-negative, 0 off the valid tokens.
        w_max: ``[]`` the largest weight on the valid tokens (-inf for none).
        num_tokens: the global number of valid tokens.
    Returns:
        ``[]`` float64; -inf when every weight is 0 (or there is none): the identity of the lse.
    """
    if weights.dtype.itemsize <= 4:
        norm = torch.linalg.vector_norm(weights, dtype=torch.float64)  # cast first, then squared
        return (norm.square() * _denominator(num_tokens, norm)).log()
    m = w_max.to(torch.float64).clamp_min(torch.finfo(torch.float64).tiny)  # all 0: sums 0, log -inf
    flat = (weights / m).reshape(-1)
    return (torch.dot(flat, flat) * _denominator(num_tokens, flat)).log() + 2.0 * m.log()


def _to_floats(values: list[Tensor]) -> list[float]:
    """Scalars -> floats: on CPU, where there is no device to synchronise with, reading each scalar
    is cheapest; on a device, :func:`gathered_floats`."""
    if all(v.is_cpu for v in values):  # (not v.device.type: a device object per value costs 1 us)
        return [v.item() for v in values]
    return gathered_floats(values)


def gathered_floats(values: list[Tensor]) -> list[float]:
    """0-d tensors -> floats with one device->host copy and few device ops (the GPU path of
    :func:`finalize_metrics`; any device, so that it is tested on CPU too).

    Most partials are views into a few flat tensors (``unbind`` of one stacked result); those bases
    are copied once each instead of stacking dozens of scalars (each stack input is a dispatch).
    """
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

    Derives, where their inputs are present: ``*chi2_seq`` from ``*chi2_seq_lse`` (NaN for a batch
    without a sequence), ``*weight_std``, ``*weight_sq_mean`` and ``*ess`` (effective sample size
    per token, ``E[w]^2 / E[w^2]`` in (0, 1]) from ``*weight_mean``, ``*weight_dev_sq_mean``
    (``E[(w - 1)^2]``) and ``*weight_sq_lse`` (``log E[w^2]``), which it drops. The ess is computed
    in log space, ``exp(2 log E[w] - log E[w^2])``: invariant to the scale of the weights and finite
    at any scale; weights that are all 0 have an ess of 0 (no token carries weight), a batch without
    a valid token NaN. A max of nothing is -inf and a min of nothing +inf: those become NaN, while a
    genuine +inf max (-inf min) stays.
    """
    keys = list(partials)
    if not keys:
        return {}
    out = dict(zip(keys, _to_floats([partials[k] for k in keys]), strict=True))
    for k in keys:
        v = out[k]
        if k.endswith("chi2_seq_lse"):
            del out[k]
            chi2 = math.exp(v) - 1.0 if v < 700 else math.inf  # e^700 ~ 1e304: the edge of float64
            out[k[: -len("_lse")]] = math.nan if v == -math.inf else chi2
        elif v in (math.inf, -math.inf):  # (most values are finite: the suffix is read only here)
            kind = reduce_kind(k)
            if (kind == "max" and v == -math.inf) or (kind == "min" and v == math.inf):
                out[k] = math.nan  # the identity of the reduction: nothing was reduced
    for k in [k for k in out if k.endswith("weight_mean")]:
        base = k[: -len("weight_mean")]
        dev = out.pop(base + "weight_dev_sq_mean", None)
        if dev is None:
            continue
        _weight_spread(out, base, out[k], dev, out.pop(base + "weight_sq_lse", None))
    return out


def _weight_spread(out: dict[str, float], base: str, mean: float, dev: float, sq_lse: float | None) -> None:
    """``weight_sq_mean``, ``weight_std`` and ``ess`` of :func:`finalize_metrics` into ``out``."""
    # Without the log partial (the fused C pass of plain ACRL): E[w^2] = E[(w - 1)^2] + 2 E[w] - 1,
    # exact where the weights live about 1. A batch without a valid token has E[w] = 0 and
    # E[(w - 1)^2] = 0 (sums over nothing), where that identity gives -1: it reads 0.
    sq = max(dev + 2.0 * mean - 1.0, 0.0) if sq_lse is None else math.exp(sq_lse)
    out[base + "weight_sq_mean"] = sq
    # Var = E[(w - 1)^2] - (E[w] - 1)^2 about 1; far below 1 (E[w^2] < E[(w - 1)^2]) that difference
    # of two numbers near 1 loses every digit, and E[w^2] - E[w]^2 is the exact one.
    var = sq - mean * mean if sq_lse is not None and sq < dev else dev - (mean - 1.0) ** 2
    out[base + "weight_std"] = math.sqrt(max(var, 0.0))
    if sq_lse is None:
        out[base + "ess"] = mean * mean / sq if sq > 0 else math.nan
    elif sq_lse == -math.inf:  # every weight 0 (no sample counts), or no valid token at all
        out[base + "ess"] = 0.0 if out.get(base + "weight_max") == 0.0 else math.nan
    else:  # scale-free; at most 1 (Cauchy-Schwarz), up to rounding
        out[base + "ess"] = min(math.exp(2.0 * math.log(mean) - sq_lse), 1.0) if mean > 0 else math.nan
