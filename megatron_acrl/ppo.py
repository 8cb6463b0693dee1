"""PPO advantages: the sequence reward on the last response token, GAE over the critic's values,
whitening over valid tokens. Pure tensor functions; ``advantages.compute_advantages`` calls
:func:`ppo_advantages` for ``algorithm.name == "ppo"`` (the critic is ``megatron_acrl.megatron.critic``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megatron_acrl.advantages import gae

__all__ = ["last_token_rewards", "masked_whiten", "ppo_advantages"]


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


def ppo_advantages(tb: dict[str, Tensor], a: Any, *, whiten: bool = True) -> tuple[Tensor, dict[str, float]]:
    """PPO: GAE over the critic's values with the sequence reward on the last response token.

    Args:
        tb: the train batch with ``rewards [N]``, ``loss_mask [N, L]`` and ``values [N, L]`` (the
            critic's V(state before token t), ``Critic.forward_values``). ``tb["returns"] [N, L]``
            (the critic's regression targets, 0 outside the mask) is written into it.
        a: ``cfg.algorithm`` (``gae_gamma``, ``gae_lambda``).
        whiten: normalise advantages over the batch's valid tokens (standard PPO practice).
    Returns:
        ``(advantages [N, L], metrics)``; metrics describe the raw (unwhitened) advantages.
    """
    if "values" not in tb:
        raise KeyError("algorithm.name=ppo needs tb['values'] from Critic.forward_values first")
    mask = tb["loss_mask"].float()
    values = tb["values"].float() * mask
    rewards = last_token_rewards(tb["rewards"].float(), mask)
    adv, returns = gae(rewards, values, mask, gamma=a.gae_gamma, lam=a.gae_lambda)
    tb["returns"] = returns
    n = mask.sum().clamp_min(1)
    metrics = {
        "advantages/mean": float(adv.sum() / n),
        "advantages/abs_mean": float(adv.abs().sum() / n),
        "critic/returns_mean": float(returns.sum() / n),
        "critic/values_mean": float(values.sum() / n),
    }
    return (masked_whiten(adv, mask) if whiten else adv), metrics
