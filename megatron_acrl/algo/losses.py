"""Policy, value, KL and entropy losses: pure tensor functions with explicit global denominators.

Every loss here returns a *partial* value: already divided by the global denominators of the
whole optimizer step (``num_tokens``: valid response tokens over all micro-batches and
data-parallel ranks; ``num_seqs``: sequences with at least one response token), so summing it over
micro-batches and ranks gives the full-batch loss and the gradient does not depend on how the
batch was split. Metrics are partials too (see :mod:`megatron_acrl.correction.metrics`).

Aggregation modes (``loss_agg``):
- ``token-mean`` (DAPO): ``sum_{i,t} l_it / num_tokens``.
- ``seq-mean-token-mean`` (GRPO): ``sum_i (sum_t l_it / |y_i|) / num_seqs``.
- ``seq-mean-token-sum-norm`` (Dr. GRPO): ``sum_{i,t} l_it / (num_seqs * norm_len)``.

Tokens dropped by a correction (weight 0: a masked or vetoed sequence, an IcePop token) still count
in the denominators; verl's rejection sampling instead removes them from its response mask, and so
from the denominators (docs/correction.md, "Conventions"). Tokens whose log pi_old or log mu is not
finite are different: they leave the loss mask itself (``correction.valid_mask``), like padding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Protocol

import torch
from torch import Tensor

from megatron_acrl.config import AlgorithmConfig, CorrectionConfig
from megatron_acrl.correction.acrl import AcrlSignal
from megatron_acrl.correction.metrics import mismatch_metrics
from megatron_acrl.correction.mismatch import MismatchTensors
from megatron_acrl.correction.weights import compute_correction


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: int | Tensor,
    num_seqs: int | Tensor,
    norm_len: int | None = None,
) -> Tensor:
    """Aggregate a per-token quantity ``[B, T]`` into a scalar partial with global denominators.

    Args:
        per_token: ``[B, T]`` values (padding may hold anything; it is masked).
        mask: ``[B, T]`` response mask.
        mode: ``token-mean``, ``seq-mean-token-mean`` or ``seq-mean-token-sum-norm``.
        num_tokens / num_seqs: global denominators.
        norm_len: constant length of ``seq-mean-token-sum-norm``.
    """
    m = mask.bool()
    x = torch.where(m, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    n_tok = torch.as_tensor(num_tokens, dtype=x.dtype, device=x.device).clamp_min(1)
    n_seq = torch.as_tensor(num_seqs, dtype=x.dtype, device=x.device).clamp_min(1)
    if mode == "token-mean":
        return x.sum() / n_tok
    if mode == "seq-mean-token-mean":
        lens = m.sum(-1).clamp_min(1).to(x.dtype)
        return (x.sum(-1) / lens).sum() / n_seq
    if mode == "seq-mean-token-sum-norm":
        if norm_len is None or norm_len < 1:
            raise ValueError("seq-mean-token-sum-norm needs norm_len >= 1 (algorithm.loss_norm_len)")
        return x.sum() / (n_seq * norm_len)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token clipped PPO surrogate (to be minimised) and the clip indicator.

    ``l = w * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` with ``r = pi / pi_old``;
    with ``dual_clip = c``, tokens with ``A < 0`` are bounded by ``-A c``.

    Args:
        logprobs: ``[B, T]`` log pi (requires grad). old_logprobs: ``[B, T]`` log pi_old.
        advantages: ``[B, T]``. mask: ``[B, T]``. weights: ``[B, T]`` detached correction weights.
    Returns:
        ``(loss [B, T], clipped [B, T] bool)``; padding entries are 0 / False.
    """
    m = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_r = torch.where(m, logprobs - old_logprobs.detach(), zero)
    ratio = torch.exp(log_r)
    adv = torch.where(m, advantages.detach(), zero)
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(l1, l2)
    clipped = (l2 > l1) & m
    if dual_clip is not None:
        l3 = -adv * dual_clip
        loss = torch.where(adv < 0, torch.minimum(loss, l3), loss)
    if weights is not None:
        loss = loss * weights.detach()
    return torch.where(m, loss, zero), clipped


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate ``[B, T]`` on samples of pi.

    ``k1 = log pi - log pi_ref``; ``k3 = r - 1 - log r`` with ``r = pi_ref / pi`` (non-negative,
    low variance). Gradients flow through ``logprobs`` only.
    """
    log_r = ref_logprobs.detach() - logprobs
    if kind == "k1":
        return -log_r
    if kind == "k3":
        log_r = log_r.clamp(-20.0, 20.0)
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {kind!r}; use k1 or k3")


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float,
    num_tokens: int | Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO value loss ``0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2)``, token-mean.

    Args:
        values: ``[B, T]`` (requires grad). old_values / returns: ``[B, T]``. mask: ``[B, T]``.
    Returns:
        ``(partial loss, partial metrics)`` with ``num_tokens`` as denominator.
    """
    m = mask.bool()
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    a = (values - returns) ** 2
    b = (v_clip - returns) ** 2
    per_tok = 0.5 * torch.maximum(a, b)
    loss = aggregate(per_tok, m, "token-mean", num_tokens=num_tokens, num_seqs=1)
    n_tok = torch.as_tensor(num_tokens, dtype=values.dtype, device=values.device).clamp_min(1)
    metrics = {
        "critic/value_loss": loss.detach(),
        "critic/value_clipfrac": ((b > a) & m).sum() / n_tok,
    }
    return loss, metrics


def rl_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    algorithm: AlgorithmConfig,
    correction: CorrectionConfig,
    acrl: AcrlSignal | None,
    num_tokens: int | Tensor,
    num_seqs: int | Tensor,
    fused: bool,
    entropy: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    norm_len: int | None = None,
    with_mismatch_metrics: bool = True,
    weight_mean: Tensor | float | None = None,
    turn_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The corrected policy loss of one micro-batch, as the Megatron loss adapter calls it.

    Args:
        logprobs: ``[B, T]`` log pi of the sampled tokens under the current weights (requires grad).
        old_logprobs: ``[B, T]`` log pi_old (trainer forward-only pass before the update).
        rollout_logprobs: ``[B, T]`` log mu from the rollout engine.
        advantages: ``[B, T]``.
        loss_mask: ``[B, T]`` 1 on response tokens; a token whose log pi_old or log mu is not finite
            is dropped from it (its gradient is 0), and should be absent from ``num_tokens`` /
            ``num_seqs`` (count them with :func:`~megatron_acrl.correction.valid_mask`).
        algorithm / correction: settings.
        acrl: controller signal of this rollout batch (``correction.method == "acrl"``).
        num_tokens / num_seqs: global denominators of the optimizer step.
        fused: compute the correction with the fused C pass (``correction.kernel`` resolved by the
            caller, :func:`~megatron_acrl.correction.fused_cpu.resolve_kernel`) or in PyTorch.
        entropy: ``[B, T]`` token entropies (requires grad if ``entropy_coef`` > 0).
        ref_logprobs: ``[B, T]`` reference-model log-probs (for ``kl_coef`` > 0).
        norm_len: Dr. GRPO constant length (default ``algorithm.loss_norm_len``).
        with_mismatch_metrics: also return the pi_old-vs-mu mismatch metrics.
        weight_mean: ``correction.batch_normalize``: the whole batch's mean weight
            (:func:`~megatron_acrl.correction.batch_weight_mean`), the same on every micro-batch and
            rank; None normalises by this micro-batch's own mean.
        turn_ids: ``[B, T]`` agent turn of each token (-1 elsewhere), for ``correction.level: segment``.
    Returns:
        ``(loss, partial metrics)``; ``loss`` summed over micro-batches and ranks is the full loss.
    """
    shared = MismatchTensors(old_logprobs, rollout_logprobs, loss_mask, fused=fused)
    corr = compute_correction(
        correction, shared, num_tokens=num_tokens, num_seqs=num_seqs, advantages=advantages, acrl=acrl,
        weight_mean=weight_mean, turn_ids=turn_ids,
    )  # fmt: skip
    loss_mask = shared.mask  # the valid tokens: a NaN log-prob never reaches the gradient
    agg = functools.partial(
        aggregate,
        mask=loss_mask,
        mode=algorithm.loss_agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_len=norm_len if norm_len is not None else algorithm.loss_norm_len,
    )
    loss, metrics = _policy_gradient(
        logprobs, old_logprobs, advantages, loss_mask, corr.weights, algorithm, agg, num_tokens
    )
    loss = _regularized(loss, metrics, logprobs, algorithm, agg, entropy, ref_logprobs)
    metrics["loss/total"] = loss.detach()
    metrics.update(corr.metrics)
    if with_mismatch_metrics:
        metrics.update(mismatch_metrics(shared, num_tokens=num_tokens, num_seqs=num_seqs))
    return loss, metrics


class PolicyLoss(Protocol):
    """A policy loss as the Megatron loss adapter calls it, once per micro-batch: its settings are
    bound at construction, the step's inputs come with the call (:class:`RLLoss`, :func:`sft_loss`)."""

    def __call__(
        self,
        logprobs: Tensor,
        micro_batch: Mapping[str, Tensor],
        num_tokens: int | Tensor,
        num_seqs: int | Tensor,
        *,
        entropy: Tensor | None = None,
        acrl: AcrlSignal | None = None,
        weight_mean: Tensor | float | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


class RLLoss:
    """:func:`rl_loss` with its settings bound once: ``loss(logprobs, micro_batch, num_tokens, num_seqs)``.

    Args:
        algorithm / correction: the run's settings.
        fused: run the correction's fused C pass (``correction.kernel`` resolved by the caller,
            :func:`~megatron_acrl.correction.fused_cpu.resolve_kernel`).
        norm_len: Dr. GRPO's constant length (None: ``algorithm.loss_norm_len``).
        with_mismatch_metrics: also return the pi_old-vs-mu mismatch metrics.
    """

    def __init__(
        self,
        algorithm: AlgorithmConfig,
        correction: CorrectionConfig,
        *,
        fused: bool,
        norm_len: int | None = None,
        with_mismatch_metrics: bool = True,
    ) -> None:
        self.algorithm = algorithm
        self.correction = correction
        self.fused = fused
        self.norm_len = norm_len
        self.with_mismatch_metrics = with_mismatch_metrics

    def __call__(
        self,
        logprobs: Tensor,
        micro_batch: Mapping[str, Tensor],
        num_tokens: int | Tensor,
        num_seqs: int | Tensor,
        *,
        entropy: Tensor | None = None,
        acrl: AcrlSignal | None = None,
        weight_mean: Tensor | float | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one micro-batch: :func:`rl_loss` on its tensors, bit for bit.

        Args:
            logprobs: ``[B, T]`` log pi under the current weights (requires grad).
            micro_batch: ``old_logprobs``, ``rollout_logprobs``, ``advantages``, ``loss_mask`` and,
                for ``kl_coef`` > 0, ``ref_logprobs`` and, for ``correction.level: segment``,
                ``turn_ids``, all ``[B, T]`` (other keys are ignored).
            num_tokens / num_seqs: the optimizer step's global denominators.
            entropy: ``[B, T]`` token entropies or None. acrl: the controller's signal of this
                rollout batch. weight_mean: ``correction.batch_normalize``'s mean weight of the step.
        """
        return rl_loss(
            logprobs,
            micro_batch["old_logprobs"],
            micro_batch["rollout_logprobs"],
            micro_batch["advantages"],
            micro_batch["loss_mask"],
            algorithm=self.algorithm,
            correction=self.correction,
            acrl=acrl,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            fused=self.fused,
            entropy=entropy,
            ref_logprobs=micro_batch.get("ref_logprobs"),
            norm_len=self.norm_len,
            with_mismatch_metrics=self.with_mismatch_metrics,
            weight_mean=weight_mean,
            turn_ids=micro_batch.get("turn_ids"),
        )


def _policy_gradient(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    weights: Tensor,
    algorithm: AlgorithmConfig,
    agg: Callable[[Tensor], Tensor],
    num_tokens: int | Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The corrected clipped surrogate, aggregated, and its partial metrics.

    Args:
        logprobs / old_logprobs / advantages / loss_mask: ``[B, T]`` as in :func:`rl_loss`.
        weights: ``[B, T]`` detached correction weights. agg: ``[B, T] -> scalar`` partial.
    Returns:
        ``(pg_loss, {"loss/pg_loss", "loss/pg_clipfrac", "loss/ppo_kl", "loss/dual_clip_frac",
        "loss/ratio_max"})``; the clip fractions and the k1 estimate of KL(pi_old || pi) are token
        means over the global ``num_tokens``; ``ratio_max`` is the largest pi / pi_old on a trained
        token (a max: MAX over micro-batches and ranks), the evidence of a ratio explosion on stale
        negative-advantage tokens, which ``dual_clip_frac`` says the dual clip bounded.
    """
    pg, clipped = ppo_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        clip_low=algorithm.clip_low,
        clip_high=algorithm.clip_high,
        dual_clip=algorithm.dual_clip,
        weights=weights,
    )
    pg_loss = agg(pg)
    n_tok = torch.as_tensor(num_tokens, dtype=logprobs.dtype, device=logprobs.device).clamp_min(1)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    m = loss_mask.bool()
    ppo_kl = torch.where(m, old_logprobs.detach() - logprobs.detach(), zero)
    ratio = torch.exp(-ppo_kl)  # pi / pi_old, 1 off the trained tokens
    dual = _dual_clipped(ratio, advantages, m, algorithm)
    stats = torch.stack([clipped.sum().to(ppo_kl.dtype), ppo_kl.sum(), dual.sum().to(ppo_kl.dtype)]) / n_tok
    metrics = {
        "loss/pg_loss": pg_loss.detach(),
        "loss/pg_clipfrac": stats[0],
        "loss/ppo_kl": stats[1],
        "loss/dual_clip_frac": stats[2],
        "loss/ratio_max": _masked_max(ratio, m),
    }
    return pg_loss, metrics


def _dual_clipped(ratio: Tensor, advantages: Tensor, mask: Tensor, algorithm: AlgorithmConfig) -> Tensor:
    """``[B, T]`` bool: the trained tokens whose loss the dual clip bounds (``A < 0`` and the clipped
    surrogate's ratio ``max(r, clip(r))`` above ``dual_clip``); none without a dual clip."""
    if algorithm.dual_clip is None:
        return torch.zeros_like(mask)
    r_clip = torch.maximum(ratio, ratio.clamp(1.0 - algorithm.clip_low, 1.0 + algorithm.clip_high))
    return mask & (advantages.detach() < 0) & (r_clip > algorithm.dual_clip)


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """The largest ``x`` on the trained tokens, ``-inf`` without any (the MAX reduction's identity:
    a ``*_max`` metric is all-reduced with MAX, :func:`~megatron_acrl.correction.reduce_kind`)."""
    if x.numel() == 0:
        return torch.full((), -torch.inf, dtype=x.dtype, device=x.device)
    return torch.where(mask, x, torch.full((), -torch.inf, dtype=x.dtype, device=x.device)).amax()


def _regularized(
    loss: Tensor,
    metrics: dict[str, Tensor],
    logprobs: Tensor,
    algorithm: AlgorithmConfig,
    agg: Callable[[Tensor], Tensor],
    entropy: Tensor | None,
    ref_logprobs: Tensor | None,
) -> Tensor:
    """``loss + kl_coef * KL(pi || pi_ref) - entropy_coef * H``; adds ``loss/kl_ref``, ``loss/entropy``.

    Args:
        entropy / ref_logprobs: ``[B, T]`` or None, as in :func:`rl_loss`.
    """
    if algorithm.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("algorithm.kl_coef > 0 needs ref_logprobs (the reference model's log-probs)")
        kl = agg(kl_penalty(logprobs, ref_logprobs, algorithm.kl_type))
        loss = loss + algorithm.kl_coef * kl
        metrics["loss/kl_ref"] = kl.detach()
    if entropy is not None:
        ent = agg(entropy)
        metrics["loss/entropy"] = ent.detach()
        if algorithm.entropy_coef:
            loss = loss - algorithm.entropy_coef * ent
    return loss


def sft_loss(
    logprobs: Tensor,
    micro_batch: Mapping[str, Tensor],
    num_tokens: int | Tensor,
    num_seqs: int | Tensor = 1,
    **_: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Supervised warm-start: token-mean negative log-likelihood of the masked (answer) tokens.

    A :class:`PolicyLoss`, so the Megatron adapter can run it; only ``micro_batch["loss_mask"]
    [B, T]`` is read, the RL inputs are ignored. Returns ``(partial loss, {"sft/nll": partial})``
    with ``num_tokens`` as denominator.
    """
    nll = aggregate(-logprobs, micro_batch["loss_mask"], "token-mean", num_tokens=num_tokens, num_seqs=1)
    return nll, {"sft/nll": nll.detach()}
