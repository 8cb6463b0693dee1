"""Per-token correction weights for the training-inference mismatch: one small function per method.

Every method reads one micro-batch's :class:`~megatron_acrl.correction.mismatch.MismatchTensors`
(``log rho = log pi_old - log mu``, ``[B, T]`` float64, 0 off the valid tokens, and their boolean
mask) and returns detached weights ``[B, T]`` that multiply the per-token policy-gradient loss. A
weight of 0 drops the token (or the whole sequence) from the gradient; the denominators are not
changed by it (verl's rejection instead removes the token from its response mask, and so from the
denominators; see docs/correction.md).

:data:`METHODS` maps the field's vocabulary (``correction.method``) to those functions, with
``rho = pi_old / mu``:

- ``none``: ``w = 1``.
- ``tis``: token truncated IS, ``w = clamp(rho, low, high)`` (slime ``--use-tis``, verl token IS).
- ``seq_tis``: sequence truncated IS, ``w = clamp(prod_t rho, low, high)`` on every token.
- ``seq_mis``: sequence masked IS, ``w = prod_t rho`` if it lies in ``[low, high]``, else 0.
- ``geo_mis``: geometric-mean rejection, keep a sequence (``w = 1``) iff ``exp(mean_t log rho)``
  lies in ``[low, high]`` (verl ``seq_mean_k1`` rejection).
- ``icepop``: ``w = rho`` if ``rho`` in ``[a, b]`` else 0.
- ``acrl``: ``w = rho ** alpha``, ``alpha = gamma * sign(A) * (1 - Y / X)`` (formula in ``acrl.py``).

One composition step, shared by every method, follows (:func:`compute_correction`): the extra
sequence masks (``masks``: the ``seq_mis`` / ``geo_mis`` bands as masks only), the veto
(``veto_threshold``: drop a sequence with any token ``rho < threshold``), batch normalisation, and the
weights' partial metrics.

``correction.level: segment`` takes the sequence-level quantities (``seq_tis``, ``seq_mis``,
``geo_mis``, the masks and the veto) over each agent turn instead of each sequence
(:data:`SEGMENT_METHODS`, :mod:`~megatron_acrl.correction.segments`, from the batch's ``turn_ids``);
their fractions are then token fractions, ``correction/seg_*_frac``.

With ``sh.fused`` (the caller chose the C kernel), plain ACRL -- no masks, veto or normalisation --
is one C pass for the weights and their metrics (:func:`fused_cpu.acrl_weights`), with the same
results as the ``acrl`` entry here (``tests/test_fused_cpu.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from megatron_acrl.config import CorrectionConfig
from megatron_acrl.correction import fused_cpu
from megatron_acrl.correction.acrl import AcrlSignal, acrl_alpha, acrl_coefficient
from megatron_acrl.correction.metrics import row_sums, sq_mean_lse, token_row_metrics, weight_metrics
from megatron_acrl.correction.mismatch import LOG_RATIO_BOUND, MismatchTensors, cached_const
from megatron_acrl.correction.segments import Segments, segments_of


@dataclass
class Correction:
    """Result of :func:`compute_correction`.

    Attributes:
        weights: ``[B, T]`` detached float weights; 0 on padding and dropped tokens/sequences.
        metrics: partial metrics (reduction by key suffix, global denominators), prefix ``correction/``.
    """

    weights: Tensor
    metrics: dict[str, Tensor]


@dataclass
class MethodWeights:
    """What one method hands the composition step.

    Attributes:
        weights: ``[B, T]`` in the log-probs' dtype, 0 on padding.
        seq_keep: ``[B]`` bool, the sequences the method itself keeps (``seq_mis``, ``geo_mis``); at
            ``level: segment`` ``[B, T]`` bool, the tokens whose segment it keeps.
        token_rows: ``[B, T]`` rows (0 on padding) reported as token means, by full metric name.
        seq_rows: ``[B]`` rows (0 for empty sequences) reported as sequence means, by full name.
        buffer: None, or ``[2 + len(token_rows), B, T]`` float64 whose row 0 is ``weights`` and rows
            2.. are ``token_rows`` (row 1 is free): the composition step then reduces them in place
            (:func:`~megatron_acrl.correction.metrics.token_row_metrics`) instead of stacking copies.
        unit_rows: ``[B, T]`` rows the segment-level composition adds (token means, reduced apart
            from ``buffer``): ``correction/seg_masked_frac``, ``correction/seg_veto_frac``.
    """

    weights: Tensor
    seq_keep: Tensor | None = None
    token_rows: dict[str, Tensor] = field(default_factory=dict)
    seq_rows: dict[str, Tensor] = field(default_factory=dict)
    buffer: Tensor | None = None
    unit_rows: dict[str, Tensor] = field(default_factory=dict)


MethodFn = Callable[[MismatchTensors, CorrectionConfig, Tensor | None, AcrlSignal | None], MethodWeights]
"""``(sh, cfg, advantages [B, T] or None, the controller's signal or None) -> MethodWeights``."""


def _zero(sh: MismatchTensors) -> Tensor:
    return cached_const(0.0, torch.float64, sh.old_logprobs.device)


def _log_band(values: Tensor, low: float, high: float) -> Tensor:
    """``low <= exp(values) <= high``, compared in log space (``low = 0``: no lower bound)."""
    lo, hi = _log_bounds(low, high)
    return (values >= lo) & (values <= hi)


def _log_bounds(low: float, high: float) -> tuple[float, float]:
    return (math.log(low) if low > 0 else -math.inf), math.log(high)


def _seq_log_ratio(sh: MismatchTensors) -> Tensor:
    """``[B]`` float64 ``log prod_t rho``."""
    return sh.seq_sums[sh.row("log_ratio")]


def _per_sequence(sh: MismatchTensors, w_seq: Tensor) -> Tensor:
    """``[B]`` float64 sequence weights -> ``[B, T]`` on the valid tokens."""
    return torch.where(sh.mask, w_seq.unsqueeze(-1), _zero(sh))


def seq_mis_keep(sh: MismatchTensors, cfg: CorrectionConfig) -> Tensor:
    """``[B]`` bool: ``prod_t rho`` in ``[seq_low, seq_high]``."""
    return _log_band(_seq_log_ratio(sh), cfg.seq_low, cfg.seq_high)


def geo_mis_keep(sh: MismatchTensors, cfg: CorrectionConfig) -> Tensor:
    """``[B]`` bool: ``exp(mean_t log rho)`` in ``[geo_low, geo_high]``."""
    return _log_band(sh.seq_mean("log_ratio"), cfg.geo_low, cfg.geo_high)


SEQUENCE_MASKS: dict[str, Callable[[MismatchTensors, CorrectionConfig], Tensor]] = {
    "seq_mis": seq_mis_keep,
    "geo_mis": geo_mis_keep,
}
"""The sequence masks ``correction.masks`` composes with any method, by name."""


def _none(
    sh: MismatchTensors, cfg: CorrectionConfig, advantages: Tensor | None, signal: AcrlSignal | None
) -> MethodWeights:
    return MethodWeights(sh.mask.to(torch.float64))


def _tis(
    sh: MismatchTensors, cfg: CorrectionConfig, advantages: Tensor | None, signal: AcrlSignal | None
) -> MethodWeights:
    rho, m = sh.rho, sh.mask
    return MethodWeights(
        torch.where(m, rho.clamp(cfg.tis_low, cfg.tis_high), _zero(sh)),
        token_rows={
            "correction/clip_frac_high": (rho > cfg.tis_high) & m,
            "correction/clip_frac_low": (rho < cfg.tis_low) & m,
        },
    )


def _icepop(
    sh: MismatchTensors, cfg: CorrectionConfig, advantages: Tensor | None, signal: AcrlSignal | None
) -> MethodWeights:
    rho, m = sh.rho, sh.mask
    high, low = (rho > cfg.icepop_high) & m, (rho < cfg.icepop_low) & m
    return MethodWeights(
        torch.where(high | low | ~m, _zero(sh), rho),
        token_rows={"correction/mask_frac_high": high, "correction/mask_frac_low": low},
    )


def _seq_tis(
    sh: MismatchTensors, cfg: CorrectionConfig, advantages: Tensor | None, signal: AcrlSignal | None
) -> MethodWeights:
    s = _seq_log_ratio(sh)
    lo, hi = _log_bounds(cfg.seq_low, cfg.seq_high)
    w_seq = torch.exp(s.clamp(lo, hi).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return MethodWeights(
        _per_sequence(sh, w_seq),
        seq_rows={
            "correction/seq_clip_frac_high": (s > hi) & sh.valid,  # an empty row has s = 0 > log hi < 0
            "correction/seq_clip_frac_low": (s < lo) & sh.valid,
        },
    )


def _seq_mis(
    sh: MismatchTensors, cfg: CorrectionConfig, advantages: Tensor | None, signal: AcrlSignal | None
) -> MethodWeights:
    w_seq = torch.exp(_seq_log_ratio(sh).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return MethodWeights(_per_sequence(sh, w_seq), seq_keep=seq_mis_keep(sh, cfg))


def _geo_mis(
    sh: MismatchTensors, cfg: CorrectionConfig, advantages: Tensor | None, signal: AcrlSignal | None
) -> MethodWeights:
    return MethodWeights(sh.mask.to(torch.float64), seq_keep=geo_mis_keep(sh, cfg))


def _acrl_inputs(advantages: Tensor | None, signal: AcrlSignal | None) -> tuple[Tensor, AcrlSignal]:
    if advantages is None or signal is None:
        raise ValueError("correction.method=acrl needs advantages and the controller's AcrlSignal")
    return advantages, signal


def _acrl(
    sh: MismatchTensors, cfg: CorrectionConfig, advantages: Tensor | None, signal: AcrlSignal | None
) -> MethodWeights:
    advantages, signal = _acrl_inputs(advantages, signal)
    coef = acrl_coefficient(cfg, signal, sh)
    if isinstance(coef, Tensor):  # per sequence: [B] float64 -> [B, 1]
        coef = coef.unsqueeze(-1)
    adv = advantages.detach()
    if adv.dim() == 2 and adv.stride(-1) == 0:  # one advantage per sequence, expanded: [B, 1] is enough
        adv = adv[:, :1]
    names = ("acrl/alpha_mean", "acrl/alpha_abs_mean", "acrl/saturated_frac")
    # the weights, a free row, then the token rows: reduced in one sum by the composition step
    buf = torch.empty((2 + len(names), *sh.mask_in.shape), dtype=torch.float64, device=sh.mask_in.device)
    weights, _, alpha, alpha_abs, saturated = buf.unbind(0)
    mf = sh.mask_f
    # alpha is 0 off the valid tokens (torch.sign(NaN) is 0, so nothing leaks through the product),
    # and so is log rho: the weight there is exp(0) = 1 until the final mask.
    torch.mul(acrl_alpha(adv, coef, cfg.alpha_max, cfg.alpha_min), mf, out=alpha)
    exponent = alpha * sh.clamped
    torch.abs(exponent, out=saturated).ge_(LOG_RATIO_BOUND)  # the weight is cut at e^+-BOUND
    torch.exp(exponent.clamp_(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), out=weights)
    if cfg.weight_low is not None or cfg.weight_high is not None:
        weights.clamp_(cfg.weight_low, cfg.weight_high)
    weights.mul_(mf)  # finite everywhere, so a product masks it
    torch.abs(alpha, out=alpha_abs)
    rows = dict(zip(names, (alpha, alpha_abs, saturated), strict=True))
    return MethodWeights(weights, token_rows=rows, buffer=buf)


METHODS: dict[str, MethodFn] = {
    "none": _none,
    "tis": _tis,
    "seq_tis": _seq_tis,
    "seq_mis": _seq_mis,
    "geo_mis": _geo_mis,
    "icepop": _icepop,
    "acrl": _acrl,
}
"""``correction.method`` -> the function computing its weights (before the composition step)."""


def _seg_tis(sh: MismatchTensors, cfg: CorrectionConfig, seg: Segments) -> MethodWeights:
    s = seg.log_ratio
    lo, hi = _log_bounds(cfg.seq_low, cfg.seq_high)
    w = torch.exp(s.clamp(lo, hi).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    m = sh.mask
    return MethodWeights(
        torch.where(m, w, _zero(sh)),
        token_rows={
            "correction/seg_clip_frac_high": (s > hi) & m,
            "correction/seg_clip_frac_low": (s < lo) & m,
        },
    )


def _seg_mis(sh: MismatchTensors, cfg: CorrectionConfig, seg: Segments) -> MethodWeights:
    w = torch.exp(seg.log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return MethodWeights(torch.where(sh.mask, w, _zero(sh)), seq_keep=seg_mis_keep(seg, cfg))


def _seg_geo_mis(sh: MismatchTensors, cfg: CorrectionConfig, seg: Segments) -> MethodWeights:
    return MethodWeights(sh.mask.to(torch.float64), seq_keep=seg_geo_keep(seg, cfg))


def seg_mis_keep(seg: Segments, cfg: CorrectionConfig) -> Tensor:
    """``[B, T]`` bool: the token's segment has ``prod rho`` in ``[seq_low, seq_high]``."""
    return _log_band(seg.log_ratio, cfg.seq_low, cfg.seq_high)


def seg_geo_keep(seg: Segments, cfg: CorrectionConfig) -> Tensor:
    """``[B, T]`` bool: the token's segment has ``exp(mean log rho)`` in ``[geo_low, geo_high]``."""
    return _log_band(seg.mean_log_ratio, cfg.geo_low, cfg.geo_high)


SEGMENT_METHODS: dict[str, Callable[[MismatchTensors, CorrectionConfig, Segments], MethodWeights]] = {
    "seq_tis": _seg_tis,
    "seq_mis": _seg_mis,
    "geo_mis": _seg_geo_mis,
}
"""``correction.level: segment``: the sequence-level methods with each turn as the unit (the other
methods are per token and have no unit)."""

SEGMENT_MASKS: dict[str, Callable[[Segments, CorrectionConfig], Tensor]] = {
    "seq_mis": seg_mis_keep,
    "geo_mis": seg_geo_keep,
}
"""``correction.masks`` at segment level: ``[B, T]`` keeps, by name."""


def _composes(cfg: CorrectionConfig) -> bool:
    """Whether the composition step changes anything beyond the method's own weights."""
    return bool(cfg.masks) or cfg.veto_threshold is not None or cfg.batch_normalize


def _compose(
    sh: MismatchTensors,
    cfg: CorrectionConfig,
    out: MethodWeights,
    weight_mean: Tensor | float | None,
    seg: Segments | None = None,
) -> Tensor:
    """Extra sequence masks, the veto, then batch normalisation, on one method's weights.

    Adds the ``seq_masked_frac`` / ``seq_veto_frac`` rows to ``out.seq_rows`` (with ``seg``, the
    segment level: ``seg_masked_frac`` / ``seg_veto_frac`` token rows to ``out.unit_rows``); returns
    the final detached ``[B, T]`` weights.
    """
    if seg is not None:
        keep = _segment_keep(sh, cfg, out, seg)
        return _normalized(sh, cfg, out.weights if keep is None else out.weights * keep, weight_mean)
    seq_keep = out.seq_keep
    for extra in cfg.masks:
        keep = SEQUENCE_MASKS[extra](sh, cfg)
        seq_keep = keep if seq_keep is None else seq_keep & keep
    if seq_keep is not None:
        out.seq_rows["correction/seq_masked_frac"] = (~seq_keep) & sh.valid
    if cfg.veto_threshold is not None:
        vetoed = ((sh.log_ratio < math.log(cfg.veto_threshold)) & sh.mask).any(-1)
        out.seq_rows["correction/seq_veto_frac"] = vetoed
        seq_keep = ~vetoed if seq_keep is None else seq_keep & ~vetoed
    weights = out.weights
    if seq_keep is not None:
        weights = weights * seq_keep.unsqueeze(-1)
    return _normalized(sh, cfg, weights, weight_mean)


def _normalized(
    sh: MismatchTensors, cfg: CorrectionConfig, weights: Tensor, weight_mean: Tensor | float | None
) -> Tensor:
    if cfg.batch_normalize:
        weights = weights / _normalizer(weights.sum(), sh, weight_mean)
    return weights.detach()


def _segment_keep(
    sh: MismatchTensors, cfg: CorrectionConfig, out: MethodWeights, seg: Segments
) -> Tensor | None:
    """``[B, T]`` bool: the tokens whose segment survives the method's keep, the masks and the veto
    (None: nothing drops a segment); their fractions (of the valid tokens) go to ``out.unit_rows``."""
    keep = out.seq_keep
    for extra in cfg.masks:
        k = SEGMENT_MASKS[extra](seg, cfg)
        keep = k if keep is None else keep & k
    if keep is not None:
        out.unit_rows["correction/seg_masked_frac"] = ~keep & sh.mask
    if cfg.veto_threshold is not None:
        vetoed = seg.vetoed(cfg.veto_threshold)
        out.unit_rows["correction/seg_veto_frac"] = vetoed
        keep = ~vetoed if keep is None else keep & ~vetoed
    return keep


def _normalizer(local_sum: Tensor, sh: MismatchTensors, weight_mean: Tensor | float | None) -> Tensor:
    """The mean ``batch_normalize`` divides by: the batch's (``weight_mean``), or this call's own."""
    if weight_mean is None:
        mean = local_sum / sh.lens.sum().clamp_min(1)
    else:
        mean = torch.as_tensor(weight_mean, dtype=torch.float64, device=local_sum.device)
    return mean.clamp_min(1e-8)


def compute_correction(
    cfg: CorrectionConfig,
    sh: MismatchTensors,
    *,
    num_tokens: int | Tensor,
    num_seqs: int | Tensor,
    advantages: Tensor | None = None,
    acrl: AcrlSignal | None = None,
    weight_mean: Tensor | float | None = None,
    turn_ids: Tensor | None = None,
) -> Correction:
    """Correction weights of ``cfg.method`` plus their partial metrics.

    Args:
        cfg: correction settings.
        sh: the micro-batch's shared intermediates (log pi_old, log mu, mask, all ``[B, T]``); its
            ``fused`` flag (the caller's kernel choice) selects the C pass for plain ACRL.
        num_tokens / num_seqs: global denominators of the metrics.
        advantages: ``[B, T]`` advantages (needed by ``acrl`` for sign(A)).
        acrl: the controller's signal for this batch (needed by ``acrl``).
        weight_mean: the batch's mean weight over its valid tokens (:func:`batch_weight_mean`) for
            ``batch_normalize``, the same for every micro-batch and rank; None uses this call's own
            tokens (exact only when this call sees the whole batch).
        turn_ids: ``[B, T]`` the turn that generated each token (-1 elsewhere), read at
            ``cfg.level == "segment"`` only: each turn is then the unit of the sequence-level methods,
            masks and veto (:mod:`~megatron_acrl.correction.segments`); None (a single-turn batch):
            each response is its one segment.
    Returns:
        :class:`Correction` with detached ``weights`` ``[B, T]`` in the log-probs' dtype (computed,
        and their metrics, in float64 on the PyTorch path).
    """
    method = METHODS.get(cfg.method)
    if method is None:
        raise ValueError(f"unknown correction.method {cfg.method!r}")
    if cfg.method == "acrl" and sh.fused and not _composes(cfg):  # one C pass (fused_cpu); same result
        return _acrl_fused(cfg, sh, num_tokens=num_tokens, advantages=advantages, acrl=acrl)
    seg = segments_of(sh, turn_ids) if cfg.level == "segment" else None
    if seg is not None and cfg.method in SEGMENT_METHODS:
        out = SEGMENT_METHODS[cfg.method](sh, cfg, seg)
    else:
        out = method(sh, cfg, advantages, acrl)
    weights = _compose(sh, cfg, out, weight_mean, seg)
    if out.buffer is None:
        metrics = weight_metrics(
            weights, sh.mask, num_tokens=num_tokens, extra_token_rows=out.token_rows, pad=sh.pad,
            mask_f=sh.mask_f,
        )  # fmt: skip
    else:
        if weights.data_ptr() != out.buffer.data_ptr():  # composed: the final weights into row 0
            out.buffer[0].copy_(weights)
        metrics = token_row_metrics(
            out.buffer, tuple(out.token_rows), num_tokens=num_tokens, mask_f=sh.mask_f, pad=sh.pad
        )
    if out.seq_rows or out.unit_rows:
        metrics.update(row_sums(out.unit_rows, out.seq_rows, num_tokens=num_tokens, num_seqs=num_seqs))
    return Correction(weights=weights.to(sh.dtype), metrics=metrics)


def batch_weight_mean(
    cfg: CorrectionConfig,
    sh: MismatchTensors,
    *,
    advantages: Tensor | None = None,
    acrl: AcrlSignal | None = None,
    turn_ids: Tensor | None = None,
) -> Tensor:
    """The mean weight over the valid tokens of a whole batch, before ``batch_normalize``.

    Computed once per batch, before its first micro-batch (like the controller's statistics), and
    passed as ``weight_mean`` to every micro-batch on every data-parallel rank, so the weights are
    normalised by one global mean, not by each micro-batch's own.

    Args:
        sh: the whole batch's shared intermediates (``[N, L]``). advantages / acrl / turn_ids: as
            for :func:`compute_correction`.
    Returns:
        ``[]`` float64 (0 for a batch without a valid token).
    """
    plain = replace(cfg, batch_normalize=False)
    corr = compute_correction(
        plain, sh, num_tokens=sh.lens.sum(), num_seqs=1, advantages=advantages, acrl=acrl, turn_ids=turn_ids
    )
    return corr.metrics["correction/weight_mean"]


def _acrl_fused(
    cfg: CorrectionConfig,
    sh: MismatchTensors,
    *,
    num_tokens: int | Tensor,
    advantages: Tensor | None,
    acrl: AcrlSignal | None,
) -> Correction:
    """:func:`compute_correction` for plain ACRL in one C pass: same weights and partial metrics as
    the ``acrl`` entry of :data:`METHODS`, which stays the reference (``tests/test_fused_cpu.py``)."""
    advantages, acrl = _acrl_inputs(advantages, acrl)
    weights, means_t, ext = fused_cpu.acrl_weights(
        sh.old_logprobs, sh.rollout_logprobs, sh.mask_in, advantages, acrl_coefficient(cfg, acrl, sh),
        num_tokens=num_tokens, alpha_max=cfg.alpha_max, alpha_min=cfg.alpha_min, weight_low=cfg.weight_low,
        weight_high=cfg.weight_high,
    )  # fmt: skip
    means = means_t.unbind(0)
    w_max, w_min = ext.unbind(0)
    names = (
        "correction/weight_mean", "correction/weight_dev_sq_mean", "acrl/alpha_mean", "acrl/alpha_abs_mean",
        "acrl/saturated_frac",
    )  # fmt: skip
    metrics = dict(zip(names, means, strict=True))
    metrics["correction/weight_max"], metrics["correction/weight_min"] = w_max, w_min
    metrics["correction/weight_sq_lse"] = sq_mean_lse(weights, w_max, num_tokens)  # the ess's E[w^2]
    return Correction(weights=weights, metrics=metrics)
