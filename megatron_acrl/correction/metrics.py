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

import functools
import math

import torch
from torch import Tensor

from megatron_acrl.correction import fused_cpu

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


@functools.lru_cache(maxsize=64)
def _const(value: float | tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small constant tensor, built once per (value, dtype, device).

    Every ``torch.tensor``/``torch.full`` call is a dispatch; on a 16 x 512 micro-batch the whole
    correction is a few dozen small ops, so constants are worth caching. Never mutate the result.
    """
    return torch.tensor(value, dtype=dtype, device=device)


class MismatchTensors:
    """Shared intermediates of one micro-batch, computed once for metrics, weights and ACRL.

    Everything is detached. Padding holds ``log pi = log mu = log rho = 0``, so every per-token
    quantity below is exactly 0 there and sums need no further masking. All per-token rows live
    in one ``[K, B, T]`` buffer written in place and reduced once: on a micro-batch the correction
    is a few dozen small ops, and their number, not their size, is what it costs.

    On CPU with float32 inputs the sums and extrema come from one fused C pass instead
    (:mod:`~megatron_acrl.correction.fused_cpu`, ``fused=True``), and the per-token rows are only
    built, by the PyTorch path, if something asks for them.

    Args:
        logp, logq: ``[B, T]`` log pi and log mu. mask: ``[B, T]`` response mask.
        fused: use the fused CPU pass (None: whenever it applies; True: required; False: never).

    Attributes:
        mask: ``[B, T]`` bool; ``mask_f``: the same as a float row; ``pad``: 0 on valid tokens,
            -inf on padding.
        log_ratio: ``[B, T]`` ``log rho = log pi - log mu``.
        clamped: ``[B, T]`` ``log rho`` clamped to +-LOG_RATIO_BOUND.
        rho: ``[B, T]`` ``exp(clamped)``.
        per_token: ``[K, B, T]`` rows named by :attr:`ROWS`.
        seq_sums: ``[K, B]`` float64 row sums over T (PyTorch path: pairwise-summed in the input
            dtype, except ``log_ratio``'s; fused path: accumulated in float64).
        extremes: ``[3]`` max over valid tokens of -log rho, log rho and |pi - mu| (-inf if none).
        lens: ``[B]`` valid tokens per sequence (float64); ``lens_c``: the same, at least 1.
        valid_f: ``[B]`` float64, 1 for sequences with a valid token, else 0.
        discrepancy: fused path only, ``[3, 2]`` float64: per distance (``prob_abs``, ``logprob_abs``,
            ``k3``) the sum over valid sequences of their mean and their number (ACRL's statistics).
    """

    ROWS = (
        "logp", "logq", "neg_log_ratio", "log_ratio", "prob_abs", "logprob_abs", "k3", "rho_sq_m1", "mask",
    )  # fmt: skip

    def __init__(self, logp: Tensor, logq: Tensor, mask: Tensor, *, fused: bool | None = None):
        m = mask if mask.dtype == torch.bool else mask.bool()
        self.mask, self.logp, self.logq = m, logp.detach(), logq.detach()
        usable = fused_cpu.usable(self.logp, self.logq, m)
        if fused and not usable:
            raise ValueError(
                "MismatchTensors(fused=True) needs 2-D float32 CPU log-probs and a built "
                "correction/_fused_cpu.c (see the log for why it did not build)"
            )
        self.fused = usable if fused is None else fused
        self.discrepancy: Tensor | None = None  # fused: [3, 2] (sum of Y_i, count) per distance
        if self.fused:
            self.seq_sums, self.extremes, self.discrepancy = fused_cpu.mismatch_pass(self.logp, self.logq, m)
        else:
            self._token_rows()

    @functools.cached_property
    def lens(self) -> Tensor:
        return self.seq_sums[-1]

    @functools.cached_property
    def lens_c(self) -> Tensor:
        return self.lens.clamp_min(1)

    @functools.cached_property
    def valid_f(self) -> Tensor:
        return self.lens.clamp_max(1)

    def _token_rows(self) -> None:
        """The PyTorch path: every per-token row, and (unless fused) the sums and extrema from them."""
        m, logp, logq = self.mask, self.logp, self.logq
        dtype, dev = torch.promote_types(logp.dtype, logq.dtype), logp.device
        zero = _const(0.0, dtype, dev)
        rows = torch.empty((len(self.ROWS), *m.shape), dtype=dtype, device=dev)
        lp, lq, nd, d, dp, ad, k3, chi, mf = rows.unbind(0)
        torch.where(m, logp, zero, out=lp)
        torch.where(m, logq, zero, out=lq)
        torch.sub(lp, lq, out=d)
        torch.sub(lq, lp, out=nd)  # k1 per token; its max is -min(log rho)
        probs = torch.exp(rows[:2])
        torch.sub(probs[0], probs[1], out=dp).abs_()
        torch.abs(d, out=ad)
        dc = d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        em1 = torch.expm1(dc)  # rho - 1 without cancellation near rho = 1
        torch.sub(em1, dc, out=k3)
        torch.add(em1, 2.0, out=chi).mul_(em1)  # rho^2 - 1 = (rho - 1)(rho + 1)
        mf.copy_(m)
        # 0 on valid tokens, -inf on padding: x + pad is x masked for a max, x - pad for a min.
        self._pad = torch.where(m, zero, _const(-math.inf, dtype, dev))
        self._mask_f, self._log_ratio, self._clamped, self._em1 = mf, d, dc, em1
        self._per_token = rows
        if self.fused:
            return
        self.seq_sums = rows.sum(-1).to(torch.float64)
        # chi2_seq is exp(2 * sum_t log rho): it amplifies any rounding of that sum, so it alone is
        # accumulated in float64 (a float64 cast of every row would cost more than all the rest).
        self.seq_sums[3] = d.sum(-1, dtype=torch.float64)
        if m.numel() == 0:
            self.extremes = _const((-math.inf,) * 3, dtype, dev)
        else:  # max(-log rho) = -min(log rho), max log rho, max |dp|: one masked reduction
            self.extremes = (rows[2:5] + self._pad).amax((1, 2))

    def _row_attr(self, name: str) -> Tensor:
        if not hasattr(self, "_per_token"):
            self._token_rows()
        return getattr(self, name)

    per_token = property(lambda self: self._row_attr("_per_token"))
    log_ratio = property(lambda self: self._row_attr("_log_ratio"))
    clamped = property(lambda self: self._row_attr("_clamped"))
    mask_f = property(lambda self: self._row_attr("_mask_f"))
    pad = property(lambda self: self._row_attr("_pad"))

    @functools.cached_property
    def valid(self) -> Tensor:
        """``[B]`` bool, sequences with at least one valid token."""
        return self.lens > 0

    @functools.cached_property
    def rho(self) -> Tensor:
        return self._row_attr("_em1") + 1.0

    def row(self, name: str) -> int:
        return self.ROWS.index(name)

    def seq_mean(self, name: str) -> Tensor:
        """``[B]`` float64 mean over each sequence's valid tokens (0 for empty sequences)."""
        return self.seq_sums[self.row(name)] / self.lens_c


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
    if sh.fused:
        values = fused_cpu.mismatch_partials(sh.seq_sums, sh.extremes, num_tokens, num_seqs)
        return {
            prefix + k: v for k, v in zip(_MISMATCH_NAMES, values.unbind(0), strict=True) if k is not None
        }
    ss = sh.seq_sums
    f64, dev = ss.dtype, ss.device
    tok = ss[2:8].sum(-1) * _denominator(num_tokens, ss)
    # Per sequence: mean log pi, mean log mu, mean log(mu / pi) = log ppl_train - log ppl_rollout.
    means = ss[:3] / sh.lens_c
    # exp(-mean log pi), exp(-mean log mu): the perplexities; exp(log ppl diff), saturated like rho.
    bound = LOG_RATIO_BOUND
    ppl = torch.exp(
        torch.clamp(
            means * _const(((-1.0,), (-1.0,), (1.0,)), f64, dev),
            _const(((-math.inf,), (-math.inf,), (-bound,)), f64, dev),
            _const(((math.inf,), (math.inf,), (bound,)), f64, dev),
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
        pad = torch.where(m, _const(0.0, w.dtype, w.device), _const(-math.inf, w.dtype, w.device))
    rows = {prefix + "weight_mean": w, prefix + "weight_sq_mean": w * w, **(extra_token_rows or {})}
    out = row_sums(rows, {}, num_tokens=num_tokens, num_seqs=1)
    if w.numel() == 0:  # an empty micro-batch: max/min of nothing, without reducing an empty tensor
        ext = _const((-math.inf, math.inf), w.dtype, w.device)
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
