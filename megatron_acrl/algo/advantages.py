"""Advantage estimators and reward shaping: GRPO, Dr. GRPO, GAE (PPO), DAPO filtering and overlong shaping.

Pure tensor functions. Sequence-level inputs are ``[N]`` (N = prompts x samples), token-level
inputs ``[N, T]`` with a response mask.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from megatron_acrl.config import AlgorithmConfig, Config


class Advantages(NamedTuple):
    """What an estimator gives the train batch: nothing is written into the batch itself.

    Attributes:
        advantages: ``[N, L]`` per-token advantages, 0 outside the loss mask.
        metrics: ``advantages/*`` (and PPO's ``critic/*``) scalars of the step.
        returns: ``[N, L]`` the critic's regression targets (PPO), 0 outside the mask; None without
            a critic.
    """

    advantages: Tensor
    metrics: dict[str, float]
    returns: Tensor | None = None


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids ``[N]`` to dense indices ``[N]`` in ``[0, G)``."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(uniq.numel())


def group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group mean, unbiased group std and group size, each ``[N]``.

    Args:
        rewards: ``[N]`` float rewards. group_ids: ``[N]`` int, equal within a prompt's samples.
    """
    idx, g = _group_index(group_ids)
    r = rewards.double()
    count = torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(0, idx, torch.ones_like(r))
    total = torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(0, idx, r)
    mean = total / count
    sq = torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(0, idx, (r - mean[idx]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    return mean[idx].to(rewards.dtype), std[idx].to(rewards.dtype), count[idx].to(rewards.dtype)


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, *, norm_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)``; Dr. GRPO with ``norm_std=False``.

    Args:
        rewards: ``[N]``. group_ids: ``[N]``.
    Returns:
        ``[N]`` sequence advantages (0 for groups whose rewards are all equal).
    """
    mean, std, _ = group_stats(rewards, group_ids)
    adv = rewards - mean
    if norm_std:
        adv = adv / (std + eps)
    return adv


def token_advantages(seq_adv: Tensor, mask: Tensor) -> Tensor:
    """Broadcast ``[N]`` sequence advantages to ``[N, T]`` response tokens (0 elsewhere)."""
    return seq_adv.unsqueeze(-1) * mask.to(seq_adv.dtype)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens.

    Args:
        rewards: ``[N, T]`` token rewards (typically the sequence reward on its last response token).
        values: ``[N, T]`` critic values V(s_t) of the state before token t.
        mask: ``[N, T]`` response mask; steps outside it are skipped (they neither bootstrap nor
            receive advantage), so padding and prompt positions do not change the result.
        gamma, lam: discount and GAE lambda.
    Returns:
        ``(advantages [N, T], returns [N, T])``, 0 outside the mask; returns = advantages + values.
    """
    m = mask.to(values.dtype)
    n, t_len = rewards.shape
    adv = torch.zeros_like(values)
    last_gae = torch.zeros(n, dtype=values.dtype, device=values.device)
    next_value = torch.zeros(n, dtype=values.dtype, device=values.device)
    for t in reversed(range(t_len)):
        mt = m[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        cur = delta + gamma * lam * last_gae
        # Outside the mask keep the running quantities untouched: the next valid step looks
        # straight through padding.
        last_gae = torch.where(mt > 0, cur, last_gae)
        next_value = torch.where(mt > 0, values[:, t], next_value)
        adv[:, t] = cur * mt
    returns = (adv + values) * m
    return adv, returns


def last_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """``[N]`` sequence rewards -> ``[N, T]`` token rewards on each row's last response token."""
    t_idx = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask > 0, t_idx, -1).amax(-1)  # -1: no response token in the row
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards[rows]
    return out


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``[N, T]`` -> zero mean, unit (unbiased) variance over the valid tokens; 0 outside ``mask``."""
    m = mask.to(x.dtype)
    n = m.sum().clamp_min(1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp_min(1)
    return (x - mean) * torch.rsqrt(var + eps) * m


def ppo_advantages(tb: Mapping[str, Tensor], a: AlgorithmConfig, *, whiten: bool = True) -> Advantages:
    """PPO: GAE over the critic's values with the sequence reward on the last response token.

    Args:
        tb: the train batch with ``rewards [N]``, ``loss_mask [N, L]`` and ``values [N, L]`` (the
            critic's V(state before token t), ``Critic.forward_values``); read only.
        a: ``cfg.algorithm`` (``gae_gamma``, ``gae_lambda``).
        whiten: normalise advantages over the batch's valid tokens (standard PPO practice).
    Returns:
        ``Advantages(advantages [N, L], metrics, returns [N, L])``: the returns (the critic's
        regression targets, 0 outside the mask) are never whitened; the metrics describe the raw
        (unwhitened) advantages.
    """
    if "values" not in tb:
        raise KeyError("algorithm.name=ppo needs tb['values'] from Critic.forward_values first")
    mask = tb["loss_mask"].float()
    values = tb["values"].float() * mask
    rewards = last_token_rewards(tb["rewards"].float(), mask)
    adv, returns = gae(rewards, values, mask, gamma=a.gae_gamma, lam=a.gae_lambda)
    n = mask.sum().clamp_min(1)
    metrics = {
        "advantages/mean": float(adv.sum() / n),
        "advantages/abs_mean": float(adv.abs().sum() / n),
        "critic/returns_mean": float(returns.sum() / n),
        "critic/values_mean": float(values.sum() / n),
    }
    return Advantages(masked_whiten(adv, mask) if whiten else adv, metrics, returns)


def dynamic_sampling_keep(rewards: Tensor, group_ids: Tensor, *, tol: float = 0.0) -> Tensor:
    """DAPO dynamic sampling: ``[N]`` bool, False for every sample of a group whose rewards are all equal.

    Such groups have zero GRPO advantage and only dilute the batch.
    """
    idx, g = _group_index(group_ids)
    r = rewards.double()
    hi = torch.full((g,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, idx, r, "amax")
    lo = torch.full((g,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, idx, r, "amin")
    return (hi - lo)[idx] > tol


def overlong_penalty(response_len: Tensor, *, max_len: int, buffer_len: int, penalty: float = 1.0) -> Tensor:
    """DAPO overlong reward shaping: additive penalty ``[N]`` for responses in the last ``buffer_len``.

    ``0`` if ``len <= max_len - buffer_len``; ``-penalty * (len - (max_len - buffer_len)) / buffer_len``
    inside the buffer; ``-penalty`` at or beyond ``max_len``.
    """
    if buffer_len <= 0:
        return torch.zeros_like(response_len, dtype=torch.float32)
    if buffer_len > max_len:
        raise ValueError(f"overlong buffer_len={buffer_len} exceeds max_len={max_len}")
    start = max_len - buffer_len
    excess = (response_len.float() - start).clamp(0, buffer_len)
    return -penalty * excess / buffer_len


def compute_advantages(tb: Mapping[str, Tensor], cfg: Config) -> Advantages:
    """Token advantages ``[N, L]`` of a rollout batch for ``cfg.algorithm``: its estimator
    (``ALGORITHMS[name].estimator``) is ``group`` (GRPO family) or ``gae`` (PPO).

    Args:
        tb: the train batch (``rewards [N]``, ``group_ids [N]``, ``loss_mask [N, L]``; PPO also
            ``values [N, L]``); read only.
    Returns:
        :class:`Advantages`; ``returns`` only for PPO.
    """
    a = cfg.algorithm
    if a.spec.estimator == "gae":  # critic + GAE; the returns are the critic's targets
        return ppo_advantages(tb, a)
    # dr_grpo's grpo_norm_std is false: its ALGORITHMS entry requires it, the config refuses true.
    seq = grpo_advantages(tb["rewards"], tb["group_ids"], norm_std=a.grpo_norm_std)
    adv = token_advantages(seq, tb["loss_mask"])
    keep = dynamic_sampling_keep(tb["rewards"], tb["group_ids"])
    metrics = {
        "advantages/mean": float(seq.mean()),
        "advantages/abs_mean": float(seq.abs().mean()),
        "advantages/zero_groups_frac": float((~keep).float().mean()),
    }
    return Advantages(adv, metrics)
