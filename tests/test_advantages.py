"""Advantages and reward shaping against straightforward references."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_acrl.algo.advantages import (
    dynamic_sampling_keep,
    gae,
    group_stats,
    grpo_advantages,
    overlong_penalty,
    token_advantages,
)


def test_grpo_reference():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    gid = torch.tensor([7, 7, 7, 7, 3, 3, 9, 9])
    adv = grpo_advantages(rewards, gid)
    # group 7: mean 0.75, unbiased std 0.5
    assert adv[:4].tolist() == pytest.approx([0.5, -1.5, 0.5, 0.5], rel=1e-5)
    assert adv[4:].abs().max() == 0  # constant groups carry no signal
    dr = grpo_advantages(rewards, gid, norm_std=False)
    assert dr[:4].tolist() == pytest.approx([0.25, -0.75, 0.25, 0.25])


def test_token_advantages_respects_mask():
    adv = token_advantages(torch.tensor([2.0, -1.0]), torch.tensor([[0, 1, 1], [1, 0, 0]]))
    assert adv.tolist() == [[0.0, 2.0, 2.0], [-1.0, 0.0, 0.0]]


def test_gae_reference_and_padding_invariance():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(2, 5, generator=g, dtype=torch.float64)
    v = torch.randn(2, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    adv, ret = gae(r, v, mask, gamma=0.9, lam=0.8)
    for i in range(2):
        n = int(mask[i].sum())
        last = 0.0
        for t in reversed(range(n)):
            nv = float(v[i, t + 1]) if t + 1 < n else 0.0
            delta = float(r[i, t]) + 0.9 * nv - float(v[i, t])
            last = delta + 0.9 * 0.8 * last
            assert adv[i, t].item() == pytest.approx(last)
            assert ret[i, t].item() == pytest.approx(last + float(v[i, t]))
    assert (adv[1, 3:] == 0).all()
    # Prompt tokens in front (mask 0) do not change the response tokens' advantages.
    pad_r = torch.cat([torch.randn(2, 3, dtype=torch.float64), r], 1)
    pad_v = torch.cat([torch.randn(2, 3, dtype=torch.float64), v], 1)
    pad_m = torch.cat([torch.zeros(2, 3, dtype=mask.dtype), mask], 1)
    adv2, _ = gae(pad_r, pad_v, pad_m, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv2[:, 3:], adv)


def test_dynamic_sampling_keep():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    gid = torch.tensor([0, 0, 1, 1, 2, 2])
    assert dynamic_sampling_keep(rewards, gid).tolist() == [False, False, True, True, False, False]


def test_overlong_penalty():
    lens = torch.tensor([10, 12, 14, 16, 20])
    pen = overlong_penalty(lens, max_len=16, buffer_len=4, penalty=1.0)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    assert overlong_penalty(lens, max_len=16, buffer_len=0).abs().sum() == 0
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lens, max_len=4, buffer_len=8)
    assert not math.isnan(pen.sum().item())


def test_group_stats_pairs_dtypes_and_the_grpo_eps():
    """A group of two has std |r1 - r2| / sqrt(2) (n - 1 = 1, unclamped); results keep the rewards'
    dtype; eps is added to the std (a std comparable to eps shows it)."""
    r = torch.tensor([1.0, 0.0, 3.0, 3.0, 3.0], dtype=torch.float32)
    gid = torch.tensor([5, 5, 2, 2, 2])
    mean, std, count = group_stats(r, gid)
    assert mean.dtype == std.dtype == count.dtype == torch.float32
    assert mean.tolist() == [0.5, 0.5, 3.0, 3.0, 3.0] and count.tolist() == [2, 2, 3, 3, 3]
    assert std.tolist() == pytest.approx([math.sqrt(0.5)] * 2 + [0.0] * 3)
    r64 = torch.tensor([0.0, 2e-6], dtype=torch.float64)
    adv = grpo_advantages(r64, torch.tensor([0, 0]), eps=1e-6)
    s = math.sqrt(2e-12)
    assert adv.dtype == torch.float64 and adv.tolist() == pytest.approx(
        [-1e-6 / (s + 1e-6), 1e-6 / (s + 1e-6)]
    )


def test_overlong_penalty_scales_with_penalty_and_buffer():
    lens = torch.tensor([11, 13, 16, 30])
    pen = overlong_penalty(lens, max_len=16, buffer_len=6, penalty=0.5)
    assert pen.dtype == torch.float32
    assert pen.tolist() == pytest.approx([-0.5 * 1 / 6, -0.5 * 3 / 6, -0.5, -0.5])
    zero = overlong_penalty(lens, max_len=16, buffer_len=0)
    assert zero.dtype == torch.float32 and zero.shape == lens.shape
    assert overlong_penalty(torch.tensor([4]), max_len=4, buffer_len=4).tolist() == [-1.0]  # buffer = max
    with pytest.raises(ValueError) as err:
        overlong_penalty(lens, max_len=4, buffer_len=8)
    assert str(err.value) == "overlong buffer_len=8 exceeds max_len=4"


def test_overlong_penalty_with_a_one_token_buffer():
    pen = overlong_penalty(torch.tensor([14, 15, 16, 18]), max_len=16, buffer_len=1, penalty=2.0)
    assert pen.tolist() == [0.0, 0.0, -2.0, -2.0]


@pytest.mark.parametrize(
    "algorithm,norm",
    [
        ({"name": "grpo"}, True),
        ({"name": "grpo", "grpo_norm_std": False}, False),
        ({"name": "dr_grpo", "grpo_norm_std": False}, False),
        ({"name": "dr_grpo"}, False),  # the name sets grpo_norm_std false (ALGORITHMS)
        ({"name": "dapo"}, True),
    ],
)
def test_compute_advantages_grpo_family(algorithm, norm):
    """GRPO normalises by the group std (unless grpo_norm_std is off); Dr. GRPO never does. Metrics:
    the sequence advantages' mean and |mean| and the fraction of samples in constant groups."""
    from megatron_acrl.algo.advantages import compute_advantages
    from megatron_acrl.config import config_from_dict

    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 3.0, 1.0])
    gid = torch.tensor([7, 7, 7, 7, 3, 3, 9, 9, 4, 4])
    mask = torch.tensor([[0, 1, 1]] * 10)
    mask[1] = torch.tensor([1, 0, 0])
    tb = {"rewards": rewards, "group_ids": gid, "loss_mask": mask}
    adv, metrics, returns = compute_advantages(tb, config_from_dict({"algorithm": algorithm}))
    assert returns is None  # no critic, no returns
    centred = [0.25, -0.75, 0.25, 0.25, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0]
    std = [0.5] * 4 + [0.0] * 4 + [math.sqrt(2.0)] * 2
    seq = [c / (s + 1e-6) if norm else c for c, s in zip(centred, std, strict=True)]
    want = [[v * float(m) for m in row] for v, row in zip(seq, mask.tolist(), strict=True)]
    assert adv.shape == (10, 3)
    for got_row, want_row in zip(adv.tolist(), want, strict=True):
        assert got_row == pytest.approx(want_row, rel=1e-6, abs=1e-9)
    assert metrics == pytest.approx(
        {
            "advantages/mean": sum(seq) / 10,
            "advantages/abs_mean": sum(abs(v) for v in seq) / 10,
            "advantages/zero_groups_frac": 0.4,
        },
        rel=1e-6,
        abs=1e-7,  # the mean is 0 up to float32 rounding
    )
