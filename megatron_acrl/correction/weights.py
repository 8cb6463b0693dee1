"""Per-token correction weights for the training-inference mismatch (pure tensor functions).

All functions take ``log_ratio = log pi_old - log mu`` ``[B, T]`` (0 on padding, see
:class:`~megatron_acrl.correction.metrics.MismatchTensors`) and the boolean response mask, and
return detached weights ``[B, T]`` that multiply the per-token policy-gradient loss. A weight of 0
drops the token (or the whole sequence) from the gradient; denominators are not changed by it.

Methods (field vocabulary):
- ``tis``: token truncated IS, ``w = clamp(rho, low, high)`` (slime ``--use-tis``, verl token IS).
- ``seq_tis``: sequence truncated IS, ``w = clamp(prod_t rho, low, high)`` on every token.
- ``seq_mis``: sequence masked IS, ``w = prod_t rho`` if it lies in ``[low, high]``, else 0.
- ``geo_mis``: geometric-mean rejection, keep a sequence (``w = 1``) iff ``exp(mean_t log rho)``
  lies in ``[low, high]`` (verl ``seq_mean_k1`` rejection).
- ``icepop``: ``w = rho`` if ``rho`` in ``[a, b]`` else 0.
- ``acrl``: ``w = rho ** alpha``, ``alpha = gamma * sign(A) * (1 - Y / X)`` (see ``acrl.py``).
- veto (any method, ``veto_threshold``): drop a sequence with any token ``rho < threshold``.
- extra sequence masks (``masks``): ``seq_mis`` / ``geo_mis`` bands composed as masks only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_acrl.config import CorrectionConfig
from megatron_acrl.correction import fused_cpu
from megatron_acrl.correction.metrics import (
    LOG_RATIO_BOUND,
    MismatchTensors,
    _const,
    row_sums,
    weight_metrics,
)


@dataclass(frozen=True)
class AcrlSignal:
    """What the ACRL controller hands the loss for one rollout batch (same on every rank).

    Attributes:
        x: reference sequence-level discrepancy X.
        y: this batch's sequence-level discrepancy Y.
    The control strength gamma lives in :class:`CorrectionConfig`.
    """

    x: float
    y: float

    def y_over_x(self, eps: float) -> float:
        return self.y / max(self.x, eps)


@dataclass
class Correction:
    """Result of :func:`compute_correction`.

    Attributes:
        weights: ``[B, T]`` detached float weights; 0 on padding and dropped tokens/sequences.
        metrics: partial metrics (reduction by key suffix, global denominators), prefix ``correction/``.
    """

    weights: Tensor
    metrics: dict[str, Tensor]


def _log_bounds(low: float, high: float) -> tuple[float, float]:
    return (math.log(low) if low > 0 else -math.inf), math.log(high)


_DISTANCE_ROW = {"prob_abs": "prob_abs", "logprob_abs": "logprob_abs", "k3": "k3"}


def _distance_row(distance: str) -> str:
    if distance not in _DISTANCE_ROW:
        raise ValueError(f"correction.distance must be prob_abs, logprob_abs or k3; got {distance!r}")
    return _DISTANCE_ROW[distance]


def _shared(logp: Tensor | None, logq: Tensor | None, mask: Tensor | None, shared: MismatchTensors | None):
    return shared if shared is not None else MismatchTensors(logp, logq, mask)  # type: ignore[arg-type]


def sequence_discrepancy(
    logp: Tensor | None,
    logq: Tensor | None,
    mask: Tensor | None,
    distance: str,
    *,
    shared: MismatchTensors | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-sequence discrepancy ``Y_i``: the mean over valid tokens of a per-token distance.

    Args:
        logp: ``[B, T]`` log pi_old. logq: ``[B, T]`` log mu. mask: ``[B, T]``.
        distance: ``prob_abs`` (|pi - mu|, the paper's), ``logprob_abs`` (|log pi - log mu|) or
            ``k3`` (rho - 1 - log rho, rho = pi / mu).
        shared: precomputed intermediates (then logp/logq/mask may be None).
    Returns:
        ``(y [B] float64, valid [B] bool)``; ``y`` is 0 for sequences with no valid token.
    """
    row = _distance_row(distance)
    sh = _shared(logp, logq, mask, shared)
    return sh.seq_mean(row), sh.valid


def acrl_discrepancy_stats(
    logp: Tensor | None,
    logq: Tensor | None,
    mask: Tensor | None,
    distance: str,
    *,
    shared: MismatchTensors | None = None,
) -> Tensor:
    """Local sufficient statistics of the batch discrepancy Y, to be all-reduced (SUM).

    Returns:
        ``[2]`` float64: (sum over valid local sequences of Y_i, number of valid local sequences).
        ``Y = stats[0] / stats[1]`` after the all-reduce over data-parallel ranks.
    """
    row = _distance_row(distance)
    sh = _shared(logp, logq, mask, shared)
    if sh.discrepancy is not None:  # the fused pass summed them already
        return sh.discrepancy[fused_cpu.DISCREPANCY_INDEX[row]]
    return torch.stack([sh.seq_mean(row), sh.valid_f]).sum(-1)


def acrl_alpha(
    advantages: Tensor,
    y_over_x: Tensor | float,
    gamma: float,
    alpha_max: float | None = None,
) -> Tensor:
    """``alpha = gamma * sign(A) * (1 - Y/X)``, optionally bounded to ``|alpha| <= alpha_max``.

    Args:
        advantages: ``[B, T]`` (or ``[B, 1]``) advantages; only their sign is used.
        y_over_x: scalar or ``[B, 1]`` (per-sequence Y) ratio Y / X.
    Returns:
        ``alpha`` broadcast to ``advantages``' shape.
    """
    alpha = torch.sign(advantages.detach()) * (gamma * (1.0 - y_over_x))
    if alpha_max is not None:
        alpha = alpha.clamp(-alpha_max, alpha_max)
    return alpha


def compute_correction(
    cfg: CorrectionConfig,
    old_logprobs: Tensor | None,
    rollout_logprobs: Tensor | None,
    mask: Tensor | None,
    *,
    num_tokens: int | Tensor,
    num_seqs: int | Tensor,
    advantages: Tensor | None = None,
    acrl: AcrlSignal | None = None,
    weight_mean: Tensor | float | None = None,
    shared: MismatchTensors | None = None,
) -> Correction:
    """Correction weights of ``cfg.method`` plus their partial metrics.

    Args:
        cfg: correction settings.
        old_logprobs: ``[B, T]`` log pi_old (trainer, before the update).
        rollout_logprobs: ``[B, T]`` log mu (rollout engine).
        mask: ``[B, T]`` response mask.
        num_tokens / num_seqs: global denominators of the metrics.
        advantages: ``[B, T]`` advantages (needed by ``acrl`` for sign(A)).
        acrl: the controller's signal for this batch (needed by ``acrl``).
        weight_mean: global mean weight over valid tokens for ``batch_normalize``; None uses this
            call's own tokens (exact only when this call sees the whole batch).
        shared: precomputed intermediates (then the three tensors may be None).
    Returns:
        :class:`Correction` with detached ``weights`` ``[B, T]``.
    """
    sh = _shared(old_logprobs, rollout_logprobs, mask, shared)
    plain_acrl = not (cfg.masks or cfg.veto_threshold is not None or cfg.batch_normalize)
    if cfg.method == "acrl" and sh.fused and plain_acrl:  # one C pass (fused_cpu); same result
        return _acrl_fused(cfg, sh, num_tokens=num_tokens, advantages=advantages, acrl=acrl)
    d, dc, m = sh.log_ratio, sh.clamped, sh.mask
    zero = _const(0.0, d.dtype, d.device)
    tok_rows: dict[str, Tensor] = {}  # [B, T] rows averaged over global tokens in one reduction
    seq_rows: dict[str, Tensor] = {}  # [B] rows averaged over global sequences in one reduction
    method = cfg.method
    seq_keep: Tensor | None = None  # [B] bool, sequences kept by masks / veto
    seq_log_ratio = sh.seq_sums[sh.row("log_ratio")]  # [B] float64: log prod_t rho

    def band(values: Tensor, low: float, high: float) -> Tensor:
        lo, hi = _log_bounds(low, high)
        return (values >= lo) & (values <= hi)

    if method == "none":
        weights = m.to(d.dtype)
    elif method == "tis":
        rho = sh.rho
        weights = torch.where(m, rho.clamp(cfg.tis_low, cfg.tis_high), zero)
        tok_rows["correction/clip_frac_high"] = (rho > cfg.tis_high) & m
        tok_rows["correction/clip_frac_low"] = (rho < cfg.tis_low) & m
    elif method == "icepop":
        rho = sh.rho
        high, low = (rho > cfg.icepop_high) & m, (rho < cfg.icepop_low) & m
        weights = torch.where(high | low | ~m, zero, rho)
        tok_rows["correction/mask_frac_high"], tok_rows["correction/mask_frac_low"] = high, low
    elif method in ("seq_tis", "seq_mis"):
        s = seq_log_ratio
        lo, hi = _log_bounds(cfg.seq_low, cfg.seq_high)
        if method == "seq_tis":
            w_seq = torch.exp(s.clamp(lo, hi).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
            seq_rows["correction/seq_clip_frac_high"] = s > hi
            seq_rows["correction/seq_clip_frac_low"] = (s < lo) & sh.valid
        else:
            seq_keep = band(s, cfg.seq_low, cfg.seq_high)
            w_seq = torch.exp(s.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        weights = torch.where(m, w_seq.to(d.dtype).unsqueeze(-1), zero)
    elif method == "geo_mis":
        weights = m.to(d.dtype)
        seq_keep = band(sh.seq_mean("log_ratio"), cfg.geo_low, cfg.geo_high)
    elif method == "acrl":
        if advantages is None or acrl is None:
            raise ValueError("correction.method=acrl needs advantages and the controller's AcrlSignal")
        if cfg.per_sequence_y:
            y_i = sh.seq_mean(_DISTANCE_ROW[cfg.distance])
            ratio: Tensor | float = (y_i / max(acrl.x, cfg.eps)).to(d.dtype).unsqueeze(-1)
        else:
            ratio = acrl.y_over_x(cfg.eps)
        # alpha is 0 on padding, so the weight there is exp(0) = 1 until the final masking.
        alpha = torch.where(m, acrl_alpha(advantages, ratio, cfg.gamma, cfg.alpha_max), zero)
        weights = (alpha * dc).clamp_(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp_()
        if cfg.weight_low is not None or cfg.weight_high is not None:
            weights = weights.clamp_(cfg.weight_low, cfg.weight_high)
        weights = torch.where(m, weights, zero, out=weights)
        tok_rows["acrl/alpha_mean"], tok_rows["acrl/alpha_abs_mean"] = alpha, alpha.abs()
    else:
        raise ValueError(f"unknown correction.method {method!r}")

    # Extra sequence masks and the veto compose with any method.
    for extra in cfg.masks:
        if extra == "seq_mis":
            keep = band(seq_log_ratio, cfg.seq_low, cfg.seq_high)
        else:
            keep = band(sh.seq_mean("log_ratio"), cfg.geo_low, cfg.geo_high)
        seq_keep = keep if seq_keep is None else seq_keep & keep
    if seq_keep is not None:
        seq_rows["correction/seq_masked_frac"] = (~seq_keep) & sh.valid
    if cfg.veto_threshold is not None:
        vetoed = ((d < math.log(cfg.veto_threshold)) & m).any(-1)
        seq_rows["correction/seq_veto_frac"] = vetoed
        seq_keep = ~vetoed if seq_keep is None else seq_keep & ~vetoed
    if seq_keep is not None:
        weights = weights * seq_keep.unsqueeze(-1)

    if cfg.batch_normalize:
        mean = weight_mean if weight_mean is not None else weights.sum() / m.sum().clamp_min(1)
        weights = weights / torch.as_tensor(mean, dtype=weights.dtype, device=weights.device).clamp_min(1e-8)

    weights = weights.detach()
    metrics = weight_metrics(weights, m, num_tokens=num_tokens, extra_token_rows=tok_rows, pad=sh.pad)
    metrics.update(row_sums({}, seq_rows, num_tokens=num_tokens, num_seqs=num_seqs))
    return Correction(weights=weights, metrics=metrics)


def _acrl_fused(
    cfg: CorrectionConfig,
    sh: MismatchTensors,
    *,
    num_tokens: int | Tensor,
    advantages: Tensor | None,
    acrl: AcrlSignal | None,
) -> Correction:
    """``compute_correction`` for plain ACRL (no masks, veto or batch normalisation) in one C pass.

    Same weights and partial metrics as the PyTorch branch, which stays the reference
    (``tests/test_fused_cpu.py``).
    """
    if advantages is None or acrl is None:
        raise ValueError("correction.method=acrl needs advantages and the controller's AcrlSignal")
    if cfg.per_sequence_y:
        y_i = sh.seq_mean(_DISTANCE_ROW[cfg.distance])
        coef: Tensor | float = (1.0 - y_i / max(acrl.x, cfg.eps)) * cfg.gamma
    else:
        coef = cfg.gamma * (1.0 - acrl.y_over_x(cfg.eps))
    weights, means_t, ext = fused_cpu.acrl_weights(
        sh.logp, sh.logq, sh.mask, advantages, coef, num_tokens=num_tokens,
        alpha_max=cfg.alpha_max, weight_low=cfg.weight_low, weight_high=cfg.weight_high,
    )  # fmt: skip
    means = means_t.unbind(0)
    w_max, w_min = ext.unbind(0)
    names = ("correction/weight_mean", "correction/weight_sq_mean", "acrl/alpha_mean", "acrl/alpha_abs_mean")
    metrics = dict(zip(names, means, strict=True))
    metrics["correction/weight_max"], metrics["correction/weight_min"] = w_max, w_min
    return Correction(weights=weights, metrics=metrics)
