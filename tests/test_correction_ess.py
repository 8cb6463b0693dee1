"""The effective sample size of the correction weights (``correction/ess`` = ``E[w]^2 / E[w^2]``) at
any scale: invariant to scaling the weights, finite down to 1e-30 (and float64's 1e-200), against a
float64 reference; every weight 0 reads 0, a batch without a valid token NaN. It used to derive
``E[w^2]`` from ``E[(w - 1)^2] + 2 E[w] - 1``, which cancels to nothing below ~1e-8 (NaN)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_acrl.correction import combine_partials, finalize_metrics, weight_metrics
from megatron_acrl.correction.metrics import sq_mean_lse

B, T = 4, 16


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` float64 weights spread over two decades (0 off the valid tokens) and the mask."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[0, 0] = True
    w = torch.exp(torch.randn(B, T, generator=g, dtype=torch.float64) * 1.5)
    return torch.where(mask, w, 0.0), mask


def reference(w: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """ess, std and E[w^2] in float64, from weights already near 1 (the scale does not enter)."""
    v = w[mask]
    return {
        "ess": float(v.sum() ** 2 / (v.numel() * (v * v).sum())),
        "std": float(v.std(unbiased=False)),
        "sq": float((v * v).mean()),
    }


def metrics(w: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return finalize_metrics(weight_metrics(w, mask, num_tokens=int(mask.sum())))


@pytest.mark.parametrize("scale", [1.0, 1e-8, 1e-12, 1e-16, 1e-20, 1e-25, 1e-30, 1e-200, 1e30])
def test_the_ess_is_scale_invariant_and_matches_the_float64_reference(scale: float) -> None:
    w, mask = batch()
    want = reference(w, mask)
    got = metrics(w * scale, mask)
    assert math.isfinite(got["correction/ess"]) and 0 < got["correction/ess"] <= 1
    assert got["correction/ess"] == pytest.approx(want["ess"], rel=1e-12)
    assert got["correction/weight_std"] == pytest.approx(want["std"] * scale, rel=1e-9)
    if scale > 1e-150:  # E[w^2] itself is below float64 at 1e-200 (it reads 0), never the ess
        assert got["correction/weight_sq_mean"] == pytest.approx(want["sq"] * scale**2, rel=1e-12)


@pytest.mark.parametrize("scale", [1e-12, 1e-20, 1e-30])
def test_float32_weights_keep_their_ess_too(scale: float) -> None:
    """The fused ACRL pass hands float32 weights: their squares are summed in float64, unscaled."""
    w, mask = batch(1)
    w32 = (w * scale).float()
    want = reference(w32.double() / scale, mask)
    assert metrics(w32, mask)["correction/ess"] == pytest.approx(want["ess"], rel=1e-12)
    lse = sq_mean_lse(w32, w32.max(), int(mask.sum()))
    assert float(lse) == pytest.approx(math.log(want["sq"]) + 2 * math.log(scale), rel=1e-9)


def test_micro_batches_and_ranks_combine_to_the_whole_batch() -> None:
    """The ``weight_sq_lse`` partial is lse-reduced: halves at scales 1e-30 and 1e-10 (each its own
    largest weight) combine to the ess of the whole."""
    w, mask = batch(2)
    w = w * torch.tensor([1e-30, 1e-30, 1e-10, 1e-10], dtype=torch.float64).unsqueeze(-1)
    n = int(mask.sum())
    parts = [weight_metrics(w[i : i + 2], mask[i : i + 2], num_tokens=n) for i in (0, 2)]
    got = finalize_metrics(combine_partials(parts))
    whole = finalize_metrics(weight_metrics(w, mask, num_tokens=n))
    v = w[mask]
    want = float(v.sum() ** 2 / (n * (v * v).sum()))
    assert got["correction/ess"] == pytest.approx(want, rel=1e-12)
    assert whole["correction/ess"] == pytest.approx(want, rel=1e-12)
    assert got["correction/weight_mean"] == pytest.approx(float(v.mean()), rel=1e-12)


def test_all_zero_weights_have_an_ess_of_zero_and_no_token_nan() -> None:
    w, mask = batch(3)
    zero = metrics(torch.zeros_like(w), mask)
    assert zero["correction/ess"] == 0.0  # no token carries weight: no effective sample
    assert zero["correction/weight_sq_mean"] == 0.0 and zero["correction/weight_std"] == 0.0
    one_left = torch.zeros_like(w)
    one_left[0, 0] = 1e-30  # one token of n carries all the weight: ess 1/n
    assert metrics(one_left, mask)["correction/ess"] == pytest.approx(1 / int(mask.sum()), rel=1e-12)
    none = metrics(torch.zeros_like(w), torch.zeros_like(mask))  # (weights are 0 off the valid tokens)
    assert math.isnan(none["correction/ess"]) and none["correction/weight_sq_mean"] == 0.0
    # an empty micro-batch combines as the identity of every reduction
    n = int(mask.sum())
    parts = [weight_metrics(w, mask, num_tokens=n), weight_metrics(w[:0], mask[:0], num_tokens=n)]
    assert finalize_metrics(combine_partials(parts))["correction/ess"] == pytest.approx(
        reference(w, mask)["ess"], rel=1e-12
    )
