"""Training-inference mismatch metrics with explicit global denominators.

Inputs are the trainer's log-probs ``log pi`` and the rollout engine's ``log mu`` of the sampled
tokens, both ``[B, T]`` float32, and a response mask ``[B, T]`` (1 on response tokens). Padding
may hold anything (even inf/nan): it never reaches a result.

Every function here returns *partial* metrics: values that combine over micro-batches and
data-parallel ranks by a reduction named by the key's suffix:

- ``*_max``: MAX, ``*_min``: MIN,
- ``*_lse``: log-sum-exp (``torch.logaddexp``), for quantities that overflow in linear space,
- everything else: SUM. Means are already divided by the *global* denominators passed in
  (``num_tokens``: valid tokens of the whole batch, ``num_seqs``: sequences with at least one valid
  token), so the sum of the parts is the metric of the whole batch, exactly.

:func:`finalize_metrics` turns reduced partials into final floats (one host sync) and derives the
non-additive metrics (std, effective sample size, chi2_seq).

Names follow verl's ``rollout_corr/*`` vocabulary under the prefix ``mismatch/``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# exp() of a log-ratio beyond this bound is treated as saturated: rho = e^20 ~ 5e8 is already a
# catastrophic mismatch, and the bound keeps rho^2 finite in float32.
LOG_RATIO_BOUND = 20.0


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


def all_reduce_partials(partials: dict[str, Tensor], group=None) -> dict[str, Tensor]:
    """All-reduce partial metrics over ``group`` (e.g. the data-parallel group), one call per kind.

    ``lse`` entries are reduced exactly: all-reduce MAX of the values, then SUM of exp(v - max).
    """
    import torch.distributed as dist

    keys = sorted(partials)
    out: dict[str, Tensor] = {}
    by_kind: dict[str, list[str]] = {"sum": [], "max": [], "min": [], "lse": []}
    for k in keys:
        by_kind[reduce_kind(k)].append(k)
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    for kind, names in by_kind.items():
        if not names:
            continue
        flat = torch.stack([partials[k].detach().float().reshape(()) for k in names])
        if kind == "lse":
            peak = flat.clone()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            safe_peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
            scaled = torch.exp(flat - safe_peak)
            dist.all_reduce(scaled, op=dist.ReduceOp.SUM, group=group)
            flat = torch.log(scaled) + safe_peak
        else:
            dist.all_reduce(flat, op=ops[kind], group=group)
        out.update(zip(names, flat.unbind(0), strict=True))
    return out


def _denominator(n: int | Tensor, like: Tensor) -> Tensor | float:
    """1 / max(n, 1), as a Python float when ``n`` is a Python int (saves a device op)."""
    if isinstance(n, Tensor):
        return 1.0 / n.to(like.dtype).clamp_min(1)
    return 1.0 / max(float(n), 1.0)


def _masked_extremes(stacked: Tensor, m: Tensor) -> Tensor:
    """``[2, K]``: max and min over valid entries of each row of ``stacked`` ``[K, B, T]``.

    Rows of an empty selection give -inf (max) / +inf (min).
    """
    k = stacked.shape[0]
    if m.numel() == 0:  # an empty micro-batch; shapes are known without a device sync
        inf = torch.full((k,), math.inf, dtype=stacked.dtype, device=stacked.device)
        return torch.stack([-inf, inf])
    inf = torch.tensor(math.inf, dtype=stacked.dtype, device=stacked.device)
    return torch.stack(
        [torch.where(m, stacked, -inf).amax((1, 2)), torch.where(m, stacked, inf).amin((1, 2))]
    )


class MismatchTensors:
    """Shared intermediates of one micro-batch, computed once for metrics, weights and ACRL.

    Everything is detached. Padding holds ``log pi = log mu = log rho = 0``, so every per-token
    quantity below is exactly 0 there and sums need no further masking.

    Attributes:
        mask: ``[B, T]`` bool.
        log_ratio: ``[B, T]`` ``log rho = log pi - log mu``.
        clamped: ``[B, T]`` ``log rho`` clamped to +-LOG_RATIO_BOUND.
        rho: ``[B, T]`` ``exp(clamped)``.
        per_token: ``[K, B, T]`` rows named by :attr:`ROWS` (the first three are the ones whose
            extremes are reported).
        seq_sums: ``[K, B]`` row sums over T (float64).
        lens: ``[B]`` valid tokens per sequence (float64); ``valid``: ``[B]`` bool.
    """

    ROWS = ("log_ratio", "logprob_abs", "prob_abs", "k3", "rho_sq_m1", "logp", "logq")

    def __init__(self, logp: Tensor, logq: Tensor, mask: Tensor):
        m = mask if mask.dtype == torch.bool else mask.bool()
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        lp = torch.where(m, logp.detach(), zero)
        lq = torch.where(m, logq.detach(), zero)
        d = lp - lq
        dc = d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        rho = torch.exp(dc)
        self.mask, self.log_ratio, self.clamped, self.rho = m, d, dc, rho
        self.per_token = torch.stack(
            [
                d,
                d.abs(),
                (torch.exp(lp) - torch.exp(lq)).abs(),
                (rho - dc) - 1.0,
                torch.expm1(2.0 * dc),
                lp,
                lq,
            ]
        )
        # Accumulate in float64: partial sums over millions of tokens must not lose digits.
        self.seq_sums = self.per_token.sum(-1, dtype=torch.float64)
        self.lens = m.sum(-1, dtype=torch.float64)
        self.valid = self.lens > 0

    def row(self, name: str) -> int:
        return self.ROWS.index(name)

    def seq_mean(self, name: str) -> Tensor:
        """``[B]`` float64 mean over each sequence's valid tokens (0 for empty sequences)."""
        return self.seq_sums[self.row(name)] / self.lens.clamp_min(1)


_MISMATCH_NAMES = (
    "kl", "logprob_abs_diff", "prob_abs_diff", "k3_kl", "chi2_token",
    "training_ppl", "rollout_ppl", "log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio",
    "chi2_seq_lse", "log_ratio_max", "logprob_abs_diff_max", "prob_abs_diff_max", "log_ratio_min",
)  # fmt: skip


def mismatch_metrics(
    logp: Tensor | None,
    logq: Tensor | None,
    mask: Tensor | None,
    *,
    num_tokens: int | Tensor,
    num_seqs: int | Tensor,
    prefix: str = "mismatch/",
    shared: MismatchTensors | None = None,
) -> dict[str, Tensor]:
    """Partial mismatch metrics between trainer (pi) and rollout (mu) log-probs.

    Args:
        logp: ``[B, T]`` log pi of the sampled tokens (detached here).
        logq: ``[B, T]`` log mu of the same tokens.
        mask: ``[B, T]`` response mask.
        num_tokens: global number of valid tokens (all micro-batches and ranks).
        num_seqs: global number of sequences with at least one valid token.
        shared: precomputed :class:`MismatchTensors` (then logp/logq/mask may be None).
    Returns:
        Partial metrics (see module doc), keys prefixed with ``prefix``:
        ``kl`` (k1 = E[log mu - log pi]), ``k3_kl`` (E[rho - 1 - log rho]), ``chi2_token``
        (E[rho^2] - 1), ``chi2_seq_lse`` (log E[(prod rho)^2]; final ``chi2_seq``), ``training_ppl``,
        ``rollout_ppl``, ``log_ppl_diff``, ``log_ppl_abs_diff``, ``ppl_ratio`` (sequence means),
        ``logprob_abs_diff``, ``prob_abs_diff`` (token means), ``logprob_abs_diff_max``,
        ``prob_abs_diff_max``, ``log_ratio_max``/``log_ratio_min``.
    """
    sh = shared if shared is not None else MismatchTensors(logp, logq, mask)  # type: ignore[arg-type]
    ss = sh.seq_sums
    # Token means of log rho (negated below: k1 = E[log mu - log pi]), |log rho|, |dp|, k3, rho^2 - 1.
    tok = ss[:5].sum(-1) * _denominator(num_tokens, ss)
    # Per-sequence means of log pi and log mu; empty sequences have zero sums and drop out below.
    means = ss[5:7] / sh.lens.clamp_min(1)
    log_ppl_diff = (means[1] - means[0]).unsqueeze(0)  # log ppl_train - log ppl_rollout
    seq_rows = (
        torch.cat([torch.exp(-means), torch.exp(log_ppl_diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))])
        * sh.valid
    )
    seq = torch.cat([seq_rows[:2], log_ppl_diff, log_ppl_diff.abs(), seq_rows[2:]]).sum(-1)
    seq = seq * _denominator(num_seqs, ss)
    # chi2_seq: log E[(prod rho)^2] = logsumexp_i(2 * sum_t log rho) - log(num_seqs); no overflow.
    two_s = torch.where(sh.valid, 2.0 * ss[0], -math.inf)
    chi2_lse = torch.logsumexp(two_s, dim=0, keepdim=True) - _log_count(num_seqs, ss)
    ext = _masked_extremes(sh.per_token[:3], sh.mask)  # [2, 3]: max/min of log rho, |log rho|, |dp|
    values = torch.cat([-tok[:1], tok[1:], seq, chi2_lse, ext[0], ext[1, :1]])
    return {prefix + k: v for k, v in zip(_MISMATCH_NAMES, values.unbind(0), strict=True)}


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
            sums = torch.stack(list(rows.values())).sum(dims, dtype=torch.float64)
            out.update(zip(rows, (sums * _denominator(n, sums)).unbind(0), strict=True))
    return out


def weight_metrics(
    weights: Tensor,
    mask: Tensor,
    *,
    num_tokens: int | Tensor,
    prefix: str = "correction/",
    extra_token_rows: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Partial statistics of per-token correction weights over valid tokens.

    Args:
        weights: ``[B, T]`` detached correction weights (0 on padding and where a token/sequence is
            masked out).
        mask: ``[B, T]`` response mask.
        num_tokens: global number of valid tokens.
        extra_token_rows: further ``[B, T]`` rows averaged in the same reduction (full key names).
    Returns:
        ``weight_mean``, ``weight_sq_mean`` (sum-reduced; std and ``ess`` are derived in
        :func:`finalize_metrics`), ``weight_max``, ``weight_min``.
    """
    m = mask if mask.dtype == torch.bool else mask.bool()
    w = weights.detach()
    rows = {prefix + "weight_mean": w, prefix + "weight_sq_mean": w * w, **(extra_token_rows or {})}
    out = row_sums(rows, {}, num_tokens=num_tokens, num_seqs=1)
    ext = _masked_extremes(w.unsqueeze(0), m).flatten().unbind(0)
    out[prefix + "weight_max"], out[prefix + "weight_min"] = ext
    return out


def _to_floats(values: list[Tensor]) -> list[float]:
    """Scalars -> floats with one device->host copy and few device ops.

    Most partials are views into a few flat tensors (``unbind`` of one stacked result); those bases
    are copied once each instead of stacking dozens of scalars (each stack input is a dispatch).
    """
    sources: list[Tensor] = []
    where: dict[int, int] = {}  # id(source) -> index into sources
    place: list[tuple[int, int]] = []  # (source index, element offset) per value
    for v in values:
        base = v._base
        if (
            base is not None
            and base.dim() == 1
            and base.is_contiguous()
            and v.dim() == 0
            and base.dtype == v.dtype
        ):
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
    flat = (
        torch.cat([s.detach().double() for s in sources]) if len(sources) > 1 else sources[0].double()
    ).tolist()
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
        elif reduce_kind(k) in ("max", "min") and math.isinf(out[k]):
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
