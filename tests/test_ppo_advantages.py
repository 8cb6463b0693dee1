"""PPO advantages (``megatron_acrl.algo.advantages``): token rewards, GAE, whitening, the returns contract."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_acrl.algo.advantages import (
    compute_advantages,
    last_token_rewards,
    masked_whiten,
    ppo_advantages,
)
from megatron_acrl.config import config_from_dict


def _batch() -> dict[str, torch.Tensor]:
    mask = torch.tensor(
        [
            [0, 0, 1, 1, 1, 0],  # prompt 2, response 3, right padding 1
            [0, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 0],  # no response token (e.g. an empty completion)
        ],
        dtype=torch.float32,
    )
    g = torch.Generator().manual_seed(0)
    return {
        "rewards": torch.tensor([1.0, -0.5, 2.0]),
        "group_ids": torch.tensor([0, 0, 1]),
        "loss_mask": mask,
        "values": torch.randn(3, 6, generator=g),
    }


def test_last_token_rewards_places_the_reward_on_the_last_response_token():
    tb = _batch()
    r = last_token_rewards(tb["rewards"], tb["loss_mask"])
    assert r.tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, -0.5], [0] * 6]


def test_masked_whiten_statistics_over_valid_tokens_only():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w = masked_whiten(x, m)
    valid = w[m > 0]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.std().item() == pytest.approx(1.0, rel=1e-5)
    assert w[m == 0].abs().max() == 0


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8)])
def test_ppo_advantages_match_a_reference_loop(gamma, lam):
    tb = _batch()
    cfg = config_from_dict({"algorithm": {"name": "ppo", "gae_gamma": gamma, "gae_lambda": lam}})
    before = dict(tb)
    adv, metrics, returns = compute_advantages(tb, cfg)
    assert tb.keys() == before.keys()  # read only: the returns come back, nothing is written into the batch
    raw, _, raw_returns = ppo_advantages(tb, cfg.algorithm, whiten=False)
    assert torch.equal(raw_returns, returns)  # whitening touches the advantages only
    # Reference: over each row's response tokens only, values[t] = V(state before token t).
    mask, values = tb["loss_mask"], tb["values"]
    for i in range(2):
        idx = mask[i].nonzero().squeeze(-1).tolist()
        nxt, running = 0.0, 0.0
        for j, t in reversed(list(enumerate(idx))):
            reward = tb["rewards"][i].item() if j == len(idx) - 1 else 0.0
            delta = reward + gamma * nxt - values[i, t].item()
            running = delta + gamma * lam * running
            nxt = values[i, t].item()
            assert raw[i, t].item() == pytest.approx(running, rel=1e-5, abs=1e-6)
            expected_return = running + values[i, t].item()
            assert returns[i, t].item() == pytest.approx(expected_return, rel=1e-5, abs=1e-6)
    assert raw[mask == 0].abs().max() == 0 and returns[mask == 0].abs().max() == 0
    assert adv[mask > 0].mean().item() == pytest.approx(0.0, abs=1e-6)  # whitened
    assert torch.allclose(adv, masked_whiten(raw, mask))
    assert {"advantages/mean", "critic/returns_mean", "critic/values_mean"} <= set(metrics)


def test_ppo_needs_the_critic_values():
    tb = _batch()
    del tb["values"]
    with pytest.raises(KeyError, match="Critic.forward_values"):
        compute_advantages(tb, config_from_dict({"algorithm": {"name": "ppo"}}))


def test_last_token_rewards_edges_and_dtype():
    """A response of one token at position 0 still gets its reward; float64 rewards stay float64."""
    mask = torch.tensor([[1, 0, 0], [0, 0, 0], [0, 1, 1]])
    r = last_token_rewards(torch.tensor([0.1, 7.0, -0.3], dtype=torch.float64), mask)
    assert r.dtype == torch.float64
    assert r.tolist() == [[0.1, 0, 0], [0, 0, 0], [0, 0, -0.3]]


def test_masked_whiten_small_counts():
    """One valid token whitens to 0; two use n - 1 = 1; a constant input is 0, never NaN (eps > 0)."""
    x = torch.tensor([[5.0, 1.0, 3.0]], dtype=torch.float64)
    assert masked_whiten(x, torch.tensor([[1, 0, 0]])).tolist() == [[0.0, 0.0, 0.0]]
    two = masked_whiten(x, torch.tensor([[1, 1, 0]]))
    # mean 3, unbiased var (4 + 4) / 1 = 8
    assert two[0].tolist() == pytest.approx(
        [2 / math.sqrt(8 + 1e-8), -2 / math.sqrt(8 + 1e-8), 0.0], rel=1e-12
    )
    const = masked_whiten(torch.full((2, 2), 4.0, dtype=torch.float64), torch.ones(2, 2))
    assert const.tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_ppo_metrics_are_token_means_of_the_raw_advantages():
    tb = _batch()
    cfg = config_from_dict({"algorithm": {"name": "ppo", "gae_gamma": 0.9, "gae_lambda": 0.8}})
    raw, metrics, returns = ppo_advantages(tb, cfg.algorithm, whiten=False)
    mask = tb["loss_mask"]
    n = mask.sum().item()
    want = {
        "advantages/mean": raw.sum().item() / n,
        "advantages/abs_mean": raw.abs().sum().item() / n,
        "critic/returns_mean": returns.sum().item() / n,
        "critic/values_mean": (tb["values"] * mask).sum().item() / n,
    }
    assert metrics == pytest.approx(want, rel=1e-6)
    one = {
        "rewards": torch.tensor([2.0]),
        "loss_mask": torch.tensor([[0.0, 1.0]]),
        "values": torch.tensor([[9.0, 0.5]]),
    }
    _, m1, _ = ppo_advantages(one, cfg.algorithm, whiten=False)  # one token: its own mean
    want1 = {
        "advantages/mean": 1.5,
        "advantages/abs_mean": 1.5,
        "critic/returns_mean": 2.0,
        "critic/values_mean": 0.5,
    }
    assert m1 == pytest.approx(want1)
    del tb["values"]
    with pytest.raises(KeyError) as err:
        ppo_advantages(tb, cfg.algorithm)
    assert err.value.args == ("algorithm.name=ppo needs tb['values'] from Critic.forward_values first",)
