"""Mismatch metrics and correction weights against the float64 reference (tests/reference.py).

Every reference and property test runs on both kernels, on the same batches: the PyTorch path
(``fused=False``) and the fused C pass (``fused=True``, where the library builds).
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import counts as reference_counts
from reference import ref_correction, ref_mismatch, ref_seq_discrepancy, ref_weights

from megatron_acrl.config import CorrectionConfig, CorrectionMethod
from megatron_acrl.correction import (
    METHODS,
    AcrlSignal,
    MismatchTensors,
    acrl_discrepancy_stats,
    combine_partials,
    compute_correction,
    finalize_metrics,
    fused_cpu,
    mismatch_metrics,
    sequence_discrepancy,
)

METHOD_NAMES = ["none", "tis", "seq_tis", "seq_mis", "geo_mis", "icepop", "acrl"]
# The two kernels: the PyTorch path, and the fused C pass where the library builds.
KERNELS = [False, True] if fused_cpu.available() else [False]
FUSED = pytest.mark.parametrize(
    "fused",
    [False, pytest.param(True, marks=pytest.mark.skipif(not fused_cpu.available(), reason="no C compiler"))],
    ids=["torch", "fused_cpu"],
)


def make_batch(seed=0, b=6, t=9, scale=0.3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    lq = lp + scale * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.bool)
    lens = torch.randint(1, t + 1, (b,), generator=g)
    for i in range(b):
        mask[i, lens[i] :] = False
    mask[-1] = False  # a sequence with no response token must not count
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone()
    adv[0] = 0.0
    return lp.to(dtype), lq.to(dtype), mask, adv.to(dtype)


def counts(mask):
    return int(mask.sum()), int(mask.any(-1).sum())


def test_method_table_covers_the_config_vocabulary():
    assert list(METHODS) == list(get_args(CorrectionMethod)) == METHOD_NAMES


@FUSED
def test_mismatch_metrics_match_reference(fused):
    lp, lq, mask, _ = make_batch()
    n_tok, n_seq = counts(mask)
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    got = finalize_metrics(mismatch_metrics(sh, num_tokens=n_tok, num_seqs=n_seq))
    want = ref_mismatch(lp, lq, mask)
    for k, v in want.items():
        assert got["mismatch/" + k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_mismatch_metrics_float64_exact():
    lp, lq, mask, _ = make_batch(dtype=torch.float64)
    n_tok, n_seq = counts(mask)
    sh = MismatchTensors(lp, lq, mask, fused=False)
    got = finalize_metrics(mismatch_metrics(sh, num_tokens=n_tok, num_seqs=n_seq))
    for k, v in ref_mismatch(lp, lq, mask).items():
        assert got["mismatch/" + k] == pytest.approx(v, rel=1e-12, abs=1e-12), k


@FUSED
def test_chi2_seq_does_not_overflow(fused):
    # prod rho = e^400 per sequence: exp(2 * 400) overflows float32 and float64 alike.
    b, t = 3, 40
    lp = torch.zeros(b, t)
    lq = torch.full((b, t), -10.0)
    mask = torch.ones(b, t, dtype=torch.bool)
    parts = mismatch_metrics(MismatchTensors(lp, lq, mask, fused=fused), num_tokens=b * t, num_seqs=b)
    assert parts["mismatch/chi2_seq_lse"].item() == pytest.approx(800.0, rel=1e-6)
    assert math.isinf(finalize_metrics(parts)["mismatch/chi2_seq"])
    lq2 = torch.full((b, t), -0.5)  # moderate: exact value e^(2*20) - 1
    sh2 = MismatchTensors(lp, lq2, mask, fused=fused)
    out = finalize_metrics(mismatch_metrics(sh2, num_tokens=b * t, num_seqs=b))
    assert out["mismatch/chi2_seq"] == pytest.approx(math.exp(40) - 1, rel=1e-5)


@FUSED
@pytest.mark.parametrize("method", METHOD_NAMES)
@pytest.mark.parametrize(
    "extra", [{}, {"masks": ("seq_mis",)}, {"veto_threshold": 0.6}, {"masks": ("geo_mis",)}]
)
def test_weights_match_reference(method, extra, fused):
    lp, lq, mask, adv = make_batch(seed=3, scale=0.15)
    cfg = CorrectionConfig(method=method, geo_low=0.9, geo_high=1.1, **extra)
    n_tok, n_seq = counts(mask)
    sig = AcrlSignal(x=0.05, y=0.08)
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    corr = compute_correction(cfg, sh, num_tokens=n_tok, num_seqs=n_seq, advantages=adv, acrl=sig)
    want = torch.tensor(ref_weights(cfg, lp, lq, mask, adv, x=0.05, y=0.08), dtype=torch.float64)
    assert not corr.weights.requires_grad
    torch.testing.assert_close(corr.weights.double(), want, rtol=1e-5, atol=1e-6)
    fin = finalize_metrics(corr.metrics)
    valid = want[mask]
    assert fin["correction/weight_mean"] == pytest.approx(valid.mean().item(), rel=1e-5)
    assert fin["correction/weight_max"] == pytest.approx(valid.max().item(), rel=1e-5)
    assert fin["correction/weight_min"] == pytest.approx(valid.min().item(), abs=1e-6)
    assert fin["correction/weight_std"] == pytest.approx(valid.std(unbiased=False).item(), rel=1e-4, abs=1e-6)
    if valid.pow(2).mean() > 0:
        ess = valid.mean() ** 2 / valid.pow(2).mean()
        assert fin["correction/ess"] == pytest.approx(ess.item(), rel=1e-4)


@pytest.mark.parametrize(
    "overrides",
    [
        {"per_sequence_y": True},
        {"alpha_max": 0.1},
        {"alpha_min": 0.0},  # sign-safe ACRL (issue #34)
        {"alpha_min": 0.0, "alpha_max": 0.3},
        {"alpha_min": -0.1, "alpha_max": 0.5, "per_sequence_y": True},
        {"weight_low": 0.9, "weight_high": 1.05},
        {"distance": "logprob_abs", "per_sequence_y": True},
        {"distance": "k3", "per_sequence_y": True},
    ],
)
@FUSED
def test_acrl_extensions_match_reference(overrides, fused):
    lp, lq, mask, adv = make_batch(seed=5, scale=0.2)
    cfg = CorrectionConfig(method="acrl", gamma=1.3, **overrides)
    n_tok, n_seq = counts(mask)
    sig = AcrlSignal(x=0.02, y=0.05)
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    corr = compute_correction(cfg, sh, num_tokens=n_tok, num_seqs=n_seq, advantages=adv, acrl=sig)
    want = torch.tensor(ref_weights(cfg, lp, lq, mask, adv, x=0.02, y=0.05), dtype=torch.float64)
    torch.testing.assert_close(corr.weights.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("distance", ["prob_abs", "logprob_abs", "k3"])
def test_sequence_discrepancy_matches_reference(distance):
    lp, lq, mask, _ = make_batch(seed=7, dtype=torch.float64)
    sh = MismatchTensors(lp, lq, mask, fused=False)
    y, valid = sequence_discrepancy(sh, distance)
    want = ref_seq_discrepancy(lp, lq, mask, distance)
    torch.testing.assert_close(y[valid], torch.tensor(want, dtype=torch.float64))
    stats = acrl_discrepancy_stats(sh, distance)
    assert stats[1].item() == len(want)
    assert stats[0].item() == pytest.approx(sum(want))


@FUSED
def test_acrl_direction(fused):
    """Y > X with A > 0: tokens the trainer likes more than the engine (rho > 1) are down-weighted."""
    lp = torch.tensor([[-0.1, -0.2]])
    lq = torch.tensor([[-0.5, -0.6]])  # rho > 1
    sh = MismatchTensors(lp, lq, torch.ones(1, 2, dtype=torch.bool), fused=fused)
    adv = torch.ones(1, 2)
    cfg = CorrectionConfig(method="acrl")
    pull = compute_correction(
        cfg, sh, num_tokens=2, num_seqs=1, advantages=adv, acrl=AcrlSignal(x=0.1, y=0.2)
    ).weights
    push = compute_correction(
        cfg, sh, num_tokens=2, num_seqs=1, advantages=adv, acrl=AcrlSignal(x=0.2, y=0.1)
    ).weights
    assert (pull < 1).all() and (push > 1).all()
    neg = compute_correction(
        cfg, sh, num_tokens=2, num_seqs=1, advantages=-adv, acrl=AcrlSignal(x=0.1, y=0.2)
    ).weights
    assert (neg > 1).all()  # sign(A) flips the direction


@FUSED
def test_acrl_requires_signal(fused):
    lp, lq, mask, adv = make_batch()
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    with pytest.raises(ValueError, match="AcrlSignal"):
        compute_correction(CorrectionConfig(method="acrl"), sh, num_tokens=1, num_seqs=1)


@FUSED
def test_fractions_and_veto_counts(fused):
    lp = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    lq = torch.tensor([[-1.5, 0.0, 2.0], [0.0, -12.0, 0.0]])  # rho = e^1.5, 1, e^-2 / 1, e^12, 1
    mask = torch.ones(2, 3, dtype=torch.bool)
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    fin = finalize_metrics(
        compute_correction(CorrectionConfig(method="tis"), sh, num_tokens=6, num_seqs=2).metrics
    )
    assert fin["correction/clip_frac_high"] == pytest.approx(2 / 6)
    assert fin["correction/clip_frac_low"] == 0.0
    fin = finalize_metrics(
        compute_correction(CorrectionConfig(method="icepop"), sh, num_tokens=6, num_seqs=2).metrics
    )
    assert fin["correction/mask_frac_high"] == pytest.approx(1 / 6)
    assert fin["correction/mask_frac_low"] == pytest.approx(1 / 6)
    lq_v = torch.tensor([[0.0, 0.0, 10.0], [0.0, 0.0, 0.0]])  # rho = e^-10 < 1e-4 in sequence 0
    corr = compute_correction(
        CorrectionConfig(method="none", veto_threshold=1e-4),
        MismatchTensors(lp, lq_v, mask, fused=fused),
        num_tokens=6,
        num_seqs=2,
    )
    assert corr.weights[0].sum() == 0 and (corr.weights[1] == 1).all()
    assert finalize_metrics(corr.metrics)["correction/seq_veto_frac"] == pytest.approx(0.5)


@FUSED
def test_batch_normalize(fused):
    lp, lq, mask, adv = make_batch(seed=11)
    n_tok, n_seq = counts(mask)
    corr = compute_correction(
        CorrectionConfig(method="tis", batch_normalize=True),
        MismatchTensors(lp, lq, mask, fused=fused),
        num_tokens=n_tok,
        num_seqs=n_seq,
    )
    assert corr.weights[mask].mean().item() == pytest.approx(1.0, rel=1e-5)


# ----------------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------------


@st.composite
def batches(draw):
    b = draw(st.integers(1, 5))
    t = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 10_000))
    scale = draw(st.sampled_from([0.0, 0.05, 0.5, 2.0]))
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 4
    lq = lp + scale * torch.randn(b, t, generator=g)
    lens = torch.randint(0, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lens.unsqueeze(1)
    if not mask.any():
        mask[0, 0] = True
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    return lp, lq, mask, adv


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(METHOD_NAMES), st.sampled_from(KERNELS))
def test_pi_equals_mu_gives_unit_weights_and_zero_divergence(batch, method, fused):
    lp, _, mask, adv = batch
    n_tok, n_seq = counts(mask)
    corr = compute_correction(
        CorrectionConfig(method=method),
        MismatchTensors(lp, lp.clone(), mask, fused=fused),
        num_tokens=n_tok,
        num_seqs=n_seq,
        advantages=adv,
        acrl=AcrlSignal(x=0.1, y=0.3),
    )
    assert torch.equal(corr.weights, mask.float())
    sh = MismatchTensors(lp, lp, mask, fused=fused)
    fin = finalize_metrics(mismatch_metrics(sh, num_tokens=n_tok, num_seqs=n_seq))
    for k in (
        "kl",
        "k3_kl",
        "chi2_token",
        "chi2_seq",
        "logprob_abs_diff",
        "prob_abs_diff",
        "log_ppl_diff",
        "log_ppl_abs_diff",
    ):
        assert fin["mismatch/" + k] == pytest.approx(0.0, abs=1e-6), k
    assert fin["mismatch/ppl_ratio"] == pytest.approx(1.0)


@settings(max_examples=60, deadline=None)
@given(batches(), st.floats(0.0, 0.9), st.floats(1.0, 5.0), st.sampled_from(KERNELS))
def test_tis_weights_never_exceed_clip(batch, low, high, fused):
    lp, lq, mask, _ = batch
    cfg = CorrectionConfig(method="tis", tis_low=low, tis_high=high)
    w = compute_correction(cfg, MismatchTensors(lp, lq, mask, fused=fused), num_tokens=1, num_seqs=1).weights
    assert (w[mask] <= high + 1e-6).all() and (w[mask] >= low - 1e-6).all()
    assert (w[~mask] == 0).all()


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(METHOD_NAMES), st.integers(1, 4), st.sampled_from(KERNELS))
def test_padding_never_changes_a_result(batch, method, pad, fused):
    lp, lq, mask, adv = batch
    n_tok, n_seq = counts(mask)
    cfg = CorrectionConfig(method=method, veto_threshold=1e-3)
    sig = AcrlSignal(x=0.1, y=0.2)
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    base = compute_correction(cfg, sh, num_tokens=n_tok, num_seqs=n_seq, advantages=adv, acrl=sig)
    b = lp.shape[0]
    junk = torch.full((b, pad), float("nan"))
    lp2, lq2 = torch.cat([lp, junk], 1), torch.cat([lq, -junk.nan_to_num(nan=-1e30)], 1)
    mask2 = torch.cat([mask, torch.zeros(b, pad, dtype=torch.bool)], 1)
    adv2 = torch.cat([adv, torch.full((b, pad), 5.0)], 1)
    # Also garbage inside the original padding positions.
    lp2 = torch.where(mask2, lp2, torch.tensor(float("inf")))
    sh2 = MismatchTensors(lp2, lq2, mask2, fused=fused)
    padded = compute_correction(cfg, sh2, num_tokens=n_tok, num_seqs=n_seq, advantages=adv2, acrl=sig)
    torch.testing.assert_close(padded.weights[:, : lp.shape[1]], base.weights)
    assert (padded.weights[:, lp.shape[1] :] == 0).all()
    a = finalize_metrics({**base.metrics, **mismatch_metrics(sh, num_tokens=n_tok, num_seqs=n_seq)})
    c = finalize_metrics({**padded.metrics, **mismatch_metrics(sh2, num_tokens=n_tok, num_seqs=n_seq)})
    assert a.keys() == c.keys()
    for k in a:
        assert c[k] == pytest.approx(a[k], rel=1e-6, abs=1e-7, nan_ok=True), k


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(METHOD_NAMES), st.data(), st.sampled_from(KERNELS))
def test_micro_batch_split_with_global_denominators_is_exact(batch, method, data, fused):
    lp, lq, mask, adv = batch
    n_tok, n_seq = counts(mask)
    cfg = CorrectionConfig(method=method, masks=("seq_mis",) if method == "acrl" else ())
    sig = AcrlSignal(x=0.1, y=0.2)

    def run(sl):
        sh = MismatchTensors(lp[sl], lq[sl], mask[sl], fused=fused)
        corr = compute_correction(cfg, sh, num_tokens=n_tok, num_seqs=n_seq, advantages=adv[sl], acrl=sig)
        return {**corr.metrics, **mismatch_metrics(sh, num_tokens=n_tok, num_seqs=n_seq)}

    b = lp.shape[0]
    cut = data.draw(st.integers(0, b))
    whole = finalize_metrics(run(slice(0, b)))
    parts = finalize_metrics(combine_partials([run(slice(0, cut)), run(slice(cut, b))]))
    for k in whole:
        assert parts[k] == pytest.approx(whole[k], rel=1e-5, abs=1e-6, nan_ok=True), k


def test_all_configs_fields_are_documented_dataclass():
    cfg = CorrectionConfig()
    assert dataclasses.is_dataclass(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.gamma = 1.0  # type: ignore[misc]


# ----------------------------------------------------------------------------------------------
# Edge defects (issue #25): each of these failed before its fix
# ----------------------------------------------------------------------------------------------


def _near_one_batch(spread: float, seed: int = 0, b: int = 8, t: int = 64):
    """float32 log-probs whose log-ratios are ``spread * N(0, 1)``: weights 1 +- spread."""
    g = torch.Generator().manual_seed(seed)
    lq = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 0.1
    lp = lq + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    return (
        lp.float(),
        lq.float(),
        torch.ones(b, t, dtype=torch.bool),
        torch.randn(b, 1, generator=g).expand(b, t),
    )


@FUSED
@pytest.mark.parametrize("spread", [3e-5, 3e-4])
@pytest.mark.parametrize("method", ["tis", "acrl"])
def test_weight_std_of_a_small_spread(spread, method, fused):
    """A true std of 3e-5 read 0 and 3e-4 read 2-3% low: the weights were squared in float32."""
    lp, lq, mask, adv = _near_one_batch(spread)
    n_tok, n_seq = counts(mask)
    cfg = CorrectionConfig(method=method, gamma=1.0)
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    corr = compute_correction(
        cfg, sh, num_tokens=n_tok, num_seqs=n_seq, advantages=adv, acrl=AcrlSignal(x=1.0, y=0.0)
    )
    got = finalize_metrics(corr.metrics)["correction/weight_std"]
    _, ref = ref_correction(cfg, lp, lq, mask, adv, x=1.0, y=0.0)
    assert ref["correction/weight_std"] > 0.5 * spread
    # float64 weights on the PyTorch path; float32 ones from the C pass, whose rounding on the grid
    # near 1 moves a std of 3e-5 by ~1e-4 (the std of the weights it returns, measured in float64)
    assert got == pytest.approx(ref["correction/weight_std"], rel=1e-3 if fused else 1e-9)
    assert got == pytest.approx(corr.weights[mask].double().std(unbiased=False).item(), rel=1e-3)


@FUSED
def test_nonfinite_old_logprobs_are_masked_and_counted(fused):
    """A NaN pi_old on a valid token gave Y = 0.124, k3 = 6e7 and an ACRL weight of e^13 (fused) or
    raised (torch): it is now dropped like padding, counted, and never reaches Y or a weight."""
    lp, lq, mask, adv = make_batch(seed=9, scale=0.2)
    lp[0, 1], lp[2, 0], lq[3, 2] = float("nan"), float("inf"), -float("inf")
    assert mask[0, 1] and mask[2, 0] and mask[3, 2]
    n_tok, n_seq = reference_counts(lp, lq, mask)
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    got = finalize_metrics(mismatch_metrics(sh, num_tokens=n_tok, num_seqs=n_seq))
    want = ref_mismatch(lp, lq, mask)
    assert want["nonfinite_tokens"] == 3
    for k, v in want.items():
        assert got["mismatch/" + k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    for distance in ("prob_abs", "logprob_abs", "k3"):
        total, count = acrl_discrepancy_stats(sh, distance).tolist()
        ys = ref_seq_discrepancy(lp, lq, mask, distance)
        assert count == len(ys) and total == pytest.approx(sum(ys), rel=1e-5), distance
    cfg = CorrectionConfig(method="acrl")
    corr = compute_correction(
        cfg, sh, num_tokens=n_tok, num_seqs=n_seq, advantages=adv, acrl=AcrlSignal(0.05, 0.08)
    )
    assert corr.weights[0, 1] == 0 and corr.weights[2, 0] == 0 and corr.weights[3, 2] == 0
    want_w = torch.tensor(ref_weights(cfg, lp, lq, mask, adv, x=0.05, y=0.08), dtype=torch.float64)
    torch.testing.assert_close(corr.weights.double(), want_w, rtol=1e-5, atol=1e-6)


@FUSED
def test_seq_clip_fractions_count_only_real_sequences(fused):
    """With seq_high < 1 the empty rows (log prod rho = 0 > log seq_high) were counted as clipped."""
    lp, lq, mask, adv = make_batch(seed=4, scale=0.05)  # the last row has no valid token
    cfg = CorrectionConfig(method="seq_tis", seq_low=0.2, seq_high=0.5)
    n_tok, n_seq = counts(mask)
    corr = compute_correction(
        cfg, MismatchTensors(lp, lq, mask, fused=fused), num_tokens=n_tok, num_seqs=n_seq
    )
    got = finalize_metrics(corr.metrics)
    _, want = ref_correction(cfg, lp, lq, mask)
    for k in ("correction/seq_clip_frac_high", "correction/seq_clip_frac_low"):
        assert 0 <= got[k] <= 1 and got[k] == pytest.approx(want[k]), k


@FUSED
def test_empty_batch_and_infinite_extremes_read_apart(fused):
    """chi2_seq of an all-masked batch read -1, and a genuine infinite extreme read NaN like an empty one."""
    lp, lq, _, _ = make_batch()
    empty = finalize_metrics(
        mismatch_metrics(MismatchTensors(lp, lq, torch.zeros_like(lp, dtype=torch.bool), fused=fused),
                         num_tokens=0, num_seqs=0)
    )  # fmt: skip
    assert math.isnan(empty["mismatch/chi2_seq"]) and math.isnan(empty["mismatch/log_ratio_max"])
    fin = finalize_metrics(
        {"a_max": torch.tensor(math.inf), "b_min": torch.tensor(-math.inf),
         "c_max": torch.tensor(-math.inf), "d_min": torch.tensor(math.inf)}
    )  # fmt: skip
    assert fin["a_max"] == math.inf and fin["b_min"] == -math.inf
    assert math.isnan(fin["c_max"]) and math.isnan(fin["d_min"])


@FUSED
@pytest.mark.parametrize("log_ratio", [1e-4, -1e-4, 3e-6])
def test_prob_abs_and_k3_without_cancellation(log_ratio, fused):
    """|pi - mu| and rho - 1 - log rho were differences of nearly equal float32 numbers: relative error
    up to 3e-3 at |log rho| ~ 1e-4, on both kernels."""
    g = torch.Generator().manual_seed(1)
    lq = -torch.rand(4, 50, generator=g) * 2 - 0.05
    lp = (lq.double() + log_ratio).float()  # the float32 inputs; the references read them exactly
    mask = torch.ones_like(lp, dtype=torch.bool)
    sh = MismatchTensors(lp, lq, mask, fused=fused)
    got = finalize_metrics(mismatch_metrics(sh, num_tokens=lp.numel(), num_seqs=4))
    want = ref_mismatch(lp, lq, mask)
    for k in ("prob_abs_diff", "prob_abs_diff_max", "k3_kl", "chi2_token", "kl", "logprob_abs_diff"):
        assert got["mismatch/" + k] == pytest.approx(want[k], rel=1e-5), k
    for distance in ("prob_abs", "k3"):
        total, _ = acrl_discrepancy_stats(sh, distance).tolist()
        assert total == pytest.approx(sum(ref_seq_discrepancy(lp, lq, mask, distance)), rel=1e-5), distance


@FUSED
def test_verl_names_of_the_perplexity_metrics(fused):
    lp, lq, mask, _ = make_batch(seed=12)
    n_tok, n_seq = counts(mask)
    got = finalize_metrics(mismatch_metrics(MismatchTensors(lp, lq, mask, fused=fused), num_tokens=n_tok,
                                            num_seqs=n_seq))  # fmt: skip
    want = ref_mismatch(lp, lq, mask)
    for k in ("training_log_ppl", "rollout_log_ppl", "log_ppl_diff_max", "log_ppl_diff_min"):
        assert got["mismatch/" + k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k


def test_overhead_benchmark_smoke():
    """benchmarks/correction_overhead.py runs both kernels on single- and multi-turn batches and ends
    with the figures, single-turn overheads first."""
    root = Path(__file__).resolve().parents[1]
    smoke = ["--tokens", "512", "--vocab", "1024", "--repeats", "2"]
    out = subprocess.run(
        [sys.executable, "benchmarks/correction_overhead.py", *smoke],
        cwd=root, capture_output=True, text=True, check=True, timeout=300,
    ).stdout.strip().splitlines()  # fmt: skip
    paths = ["fused-path", "torch-path"] if fused_cpu.available() else ["torch-path"]
    figures = ("overhead", "overhead multi-turn", "multi/single", "segment/sequence")
    want = [f"{p} {f}" for f in figures for p in paths]
    lines = out[-len(want) :]
    assert [line.rsplit(":", 1)[0] for line in lines] == want
    assert all(float(line.rsplit(":", 1)[1]) > 0 for line in lines)


@FUSED
def test_batch_weight_mean_is_the_plain_mean_and_normalises_every_micro_batch(fused):
    """batch_weight_mean: the mean TIS weight of the whole batch, before normalisation, over its valid
    tokens (reference); passed to micro-batches, their weights are the whole batch's divided by it.
    Without it a call uses its own tokens' mean -- one valid token normalises to exactly 1."""
    from megatron_acrl.correction import batch_weight_mean

    lp, lq, mask, adv = make_batch(seed=4, scale=0.6)
    cfg = CorrectionConfig(method="tis", tis_high=1.5, batch_normalize=True)
    plain = ref_weights(dataclasses.replace(cfg, batch_normalize=False), lp, lq, mask)
    n_tok = int(mask.sum())
    want = sum(map(sum, plain)) / n_tok
    mean = batch_weight_mean(cfg, MismatchTensors(lp, lq, mask, fused=fused))
    assert mean.dtype == torch.float64 and mean.item() == pytest.approx(want, rel=1e-6)
    for sl in (slice(0, 2), slice(2, None)):
        sh = MismatchTensors(lp[sl], lq[sl], mask[sl], fused=fused)
        w = compute_correction(cfg, sh, num_tokens=n_tok, num_seqs=6, weight_mean=mean.item()).weights
        expect = torch.tensor(plain, dtype=torch.float64)[sl] / want
        torch.testing.assert_close(w.double(), expect, rtol=1e-5, atol=1e-6)
    lp64, lq64 = lp.double(), lq.double()  # float64 log-probs: the mean is applied at full precision
    mean64 = batch_weight_mean(cfg, MismatchTensors(lp64, lq64, mask, fused=False)).item()
    w = compute_correction(cfg, MismatchTensors(lp64, lq64, mask, fused=False), num_tokens=n_tok, num_seqs=6,
                           weight_mean=mean64).weights  # fmt: skip
    plain64 = ref_weights(dataclasses.replace(cfg, batch_normalize=False), lp64, lq64, mask)
    want64 = sum(map(sum, plain64)) / n_tok
    torch.testing.assert_close(w, torch.tensor(plain64, dtype=torch.float64) / want64, rtol=1e-13, atol=1e-15)
    one = torch.zeros_like(mask)
    one[0, 0] = True
    lq1 = lq.clone()
    lq1[0, 0] = lp[0, 0] - 0.2  # rho = e^0.2 inside the clip: a weight of 1.22 before normalising
    w = compute_correction(cfg, MismatchTensors(lp, lq1, one, fused=fused), num_tokens=1, num_seqs=1).weights
    assert w[0, 0].item() == pytest.approx(1.0, rel=1e-6) and w.sum().item() == pytest.approx(1.0, rel=1e-6)
    # a method with sequence rows (their metrics are dropped, the mean is still the plain one)
    seq = CorrectionConfig(method="seq_tis", seq_high=1.5, masks=("geo_mis",), batch_normalize=True)
    plain = ref_weights(dataclasses.replace(seq, batch_normalize=False), lp, lq, mask)
    mean = batch_weight_mean(seq, MismatchTensors(lp, lq, mask, fused=fused))
    assert mean.item() == pytest.approx(sum(map(sum, plain)) / n_tok, rel=1e-6)


def test_valid_mask_drops_masked_and_nonfinite_tokens():
    from megatron_acrl.correction import valid_mask

    lp = torch.tensor([[-1.0, float("nan"), -2.0, -0.5]])
    lq = torch.tensor([[-1.1, -1.0, float("-inf"), -0.4]])
    for mask in (
        torch.tensor([[1, 1, 1, 0]]),
        torch.tensor([[True, True, True, False]]),
        torch.tensor([[2.0, 1, 1, 0]]),
    ):
        got = valid_mask(lp, lq, mask)
        assert got.dtype == torch.bool and got.tolist() == [[True, False, False, False]]
    assert valid_mask(lp, lq, torch.tensor([[0, 1, 1, 1]])).tolist() == [[False, False, False, True]]


@FUSED
def test_icepop_band_is_closed(fused):
    """IcePop keeps rho in [low, high], ends included: rho = 1 exactly (log pi_old = log mu) stays in
    [1, 2] and in [0.5, 1]; rho = e^-0.1 and e^0.1 fall out of one of them each."""
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    lq = torch.tensor([[-1.0, -1.9, -0.6]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    for low, high, kept, frac in ((1.0, 2.0, [1, 0, 1], "low"), (0.5, 1.0, [1, 1, 0], "high")):
        cfg = CorrectionConfig(method="icepop", icepop_low=low, icepop_high=high)
        corr = compute_correction(cfg, MismatchTensors(lp, lq, mask, fused=fused), num_tokens=3, num_seqs=1)
        assert (corr.weights > 0).int().tolist() == [kept]
        m = finalize_metrics(corr.metrics)
        assert m[f"correction/mask_frac_{frac}"] == pytest.approx(1 / 3)
        assert m["correction/mask_frac_" + ("high" if frac == "low" else "low")] == 0


def test_an_unknown_distance_is_named():
    lp, lq, mask, _ = make_batch()
    with pytest.raises(ValueError) as err:
        acrl_discrepancy_stats(MismatchTensors(lp, lq, mask, fused=False), "l2")
    assert str(err.value) == "correction.distance must be prob_abs, logprob_abs or k3; got 'l2'"


def _one_ratio_per_sequence(s: list[float], t: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 log-probs whose sequence i has sum_t log rho = s[i] exactly (all on its first token)."""
    lp = torch.full((len(s), t), -1.0, dtype=torch.float64)
    lq = lp.clone()
    lq[:, 0] = -1.0 - torch.tensor(s, dtype=torch.float64)
    return lp, lq, torch.ones(len(s), t, dtype=torch.bool)


def test_sequence_bands_at_their_edges_and_beyond_the_saturation():
    """Written from the definitions, not the code: a band [low, high] keeps prod rho on its edges
    (low = 0: no lower edge), a sequence weight saturates at e^+-20, and a clip fraction counts only
    ratios strictly outside the band."""
    # float64 log-probs, so the ratios are exact: the PyTorch path (the fused pass takes float32)
    lp, lq, mask = _one_ratio_per_sequence([0.0, 25.0, -25.0, 1.0])
    n_tok, n_seq = int(mask.sum()), 4

    def weights(**kw) -> tuple[list[float], dict[str, float]]:
        corr = compute_correction(
            CorrectionConfig(**kw),
            MismatchTensors(lp, lq, mask, fused=False),
            num_tokens=n_tok,
            num_seqs=n_seq,
        )
        return corr.weights[:, 0].tolist(), finalize_metrics(corr.metrics)

    e20 = math.exp(20.0)
    # prod rho = 1 on both edges of [1, 2] and [0.5, 1]: kept (geo_mis keeps with weight 1)
    for lo, hi in ((1.0, 2.0), (0.5, 1.0)):
        w, _ = weights(method="geo_mis", geo_low=lo, geo_high=hi)
        assert w[0] == 1.0, (lo, hi)
        w, _ = weights(method="seq_mis", seq_low=lo, seq_high=hi)
        assert w[0] == 1.0 and w[1] == w[2] == 0.0, (lo, hi)  # e^+-25 outside: masked
    # low = 0: every ratio down to 0 is in; beyond +-20 the weight saturates
    w, _ = weights(method="seq_mis", seq_low=0.0, seq_high=1e12)
    assert w[:3] == pytest.approx([1.0, e20, 1.0 / e20], rel=1e-12) and w[3] == pytest.approx(
        math.e, rel=1e-12
    )
    w, m = weights(method="seq_tis", seq_low=0.0, seq_high=1e12)
    assert w[:3] == pytest.approx([1.0, e20, 1.0 / e20], rel=1e-12)
    assert m["correction/seq_clip_frac_high"] == 0.0 and m["correction/seq_clip_frac_low"] == 0.0
    # a ratio exactly on an edge is not clipped; e^1 above a high edge of 1 is
    _, m = weights(method="seq_tis", seq_low=0.5, seq_high=1.0)
    assert m["correction/seq_clip_frac_high"] == pytest.approx(2 / 4)  # e^25 and e^1, not e^0
    _, m = weights(method="seq_tis", seq_low=1.0, seq_high=2.0)
    assert m["correction/seq_clip_frac_low"] == pytest.approx(1 / 4)  # e^-25, not e^0


def test_acrl_refuses_to_run_without_advantages_or_signal():
    lp, lq, mask = _one_ratio_per_sequence([0.1, 0.2])
    sh = MismatchTensors(lp, lq, mask, fused=False)
    cfg = CorrectionConfig(method="acrl")
    adv = torch.ones(2, 1, dtype=torch.float64)
    for kw in ({"advantages": adv}, {"acrl": AcrlSignal(x=0.1, y=0.1)}):
        with pytest.raises(
            ValueError, match=r"^correction\.method=acrl needs advantages and the controller's"
        ):
            compute_correction(cfg, sh, num_tokens=8, num_seqs=2, **kw)


def test_fused_pass_takes_only_float32_on_both_sides():
    lp, lq, mask, _ = make_batch()
    for a, b in ((lp.double(), lq), (lp, lq.double()), (lp.double(), lq.double())):
        assert not fused_cpu.usable(a, b, mask)


def _same_floats(got: list[float], want: list[float]) -> bool:
    if len(got) != len(want):
        return False
    return all(g == w or (math.isnan(g) and math.isnan(w)) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_the_device_path_of_finalize_reads_every_partial_exactly(method: str) -> None:
    """On a GPU the partials reach the host through :func:`gathered_floats` (the views of a few flat
    results copied once each); on CPU each is read alone. Both must read the same floats, for every
    method's real partials (views of unbound stacks, lone scalars, float32 and float64) and for a
    mix of views at offsets, strided views, repeats and a view of a 2-D base."""
    from megatron_acrl.correction.metrics import gathered_floats

    torch.manual_seed(3)
    b, t = 4, 9
    old = -torch.rand(b, t) * 3
    roll = old + 0.1 * torch.randn(b, t)
    mask = torch.rand(b, t) > 0.2
    mask[1] = False  # an empty sequence: -inf / +inf extremes among the partials
    old[2, 3] = math.nan
    cfg = CorrectionConfig(method=method)
    sh = MismatchTensors(old, roll, mask, fused=False)
    sig = AcrlSignal(x=0.02, y=0.05) if method == "acrl" else None
    adv = torch.randn(b, 1).expand(b, t)
    corr = compute_correction(cfg, sh, num_tokens=20, num_seqs=3, advantages=adv, acrl=sig)
    parts = list({**corr.metrics, **mismatch_metrics(sh, num_tokens=20, num_seqs=3)}.values())
    assert _same_floats(gathered_floats(parts), [v.item() for v in parts])
    flat = torch.arange(10, dtype=torch.float64) / 7
    grid = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 3
    col = grid[:, 1]  # a strided 1-D view of a 2-D base
    mix = [flat[7], flat[2], torch.tensor(-2.5), flat[2], col[2], grid[1, 3], *flat[4:].unbind(0)]
    mix += [torch.tensor([1.25], dtype=torch.float32).reshape(()), col.unbind(0)[0], flat[0]]
    # 1-D bases that are not plain: strided (stride 2), and one that starts 2 elements into its storage
    spaced = torch.empty_strided((5,), (2,), dtype=torch.float64).copy_(torch.arange(5.0) + 0.5)
    shifted = torch.empty(0).set_(torch.arange(12.0).untyped_storage(), 2, (10,), (1,))
    mix += [spaced[1], spaced[3], shifted[3], shifted[0]]
    assert (spaced.stride(0), shifted.storage_offset()) == (2, 2) and shifted[3]._base is shifted
    assert _same_floats(gathered_floats(mix), [v.item() for v in mix])
    assert gathered_floats([flat[9]]) == [flat[9].item()]


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_weight_metrics_alone_match_a_float64_reference(mask_kind: str) -> None:
    """``weight_metrics`` called on its own (no ``pad`` / ``mask_f`` from a MismatchTensors): it
    derives them from a bool or 0/1 mask, and its partials, with an extra token row, are the float64
    sums over the valid tokens divided by their count."""
    from megatron_acrl.correction import weight_metrics

    torch.manual_seed(5)
    b, t = 3, 7
    valid = torch.rand(b, t) > 0.3
    n_tok = int(valid.sum())  # the whole batch: E[w^2] is derived from E[(w - 1)^2] and E[w]
    w = torch.where(valid, 1.0 + 0.3 * torch.randn(b, t), torch.zeros(b, t)).abs()
    extra = torch.where(valid, torch.rand(b, t), torch.zeros(b, t))
    mask = valid if mask_kind == "bool" else valid.to(torch.float32)
    got = finalize_metrics(weight_metrics(w, mask, num_tokens=n_tok, extra_token_rows={"x/extra": extra}))
    cells = [(i, j) for i in range(b) for j in range(t) if valid[i, j]]
    ws = [float(w[i, j]) for i, j in cells]
    mean = sum(ws) / n_tok
    dev = sum((x - 1.0) ** 2 for x in ws) / n_tok
    assert got["correction/weight_mean"] == pytest.approx(mean, rel=1e-12)
    assert got["correction/weight_sq_mean"] == pytest.approx(sum(x * x for x in ws) / n_tok, rel=1e-12)
    assert got["correction/weight_std"] == pytest.approx(math.sqrt(dev - (mean - 1.0) ** 2), rel=1e-9)
    assert got["correction/weight_max"] == max(ws) and got["correction/weight_min"] == min(ws)
    assert got["x/extra"] == pytest.approx(sum(float(extra[i, j]) for i, j in cells) / n_tok, rel=1e-12)


def test_row_sums_are_float64_means_over_the_global_counts() -> None:
    """``row_sums``: token rows (bool fractions, float32 values) over ``num_tokens`` and sequence
    rows over ``num_seqs``, each summed in float64 (a float32 sum of 1e4 ones plus 1e-4 loses it)."""
    from megatron_acrl.correction import row_sums

    torch.manual_seed(6)
    frac = torch.rand(2, 5) > 0.5
    vals = torch.full((2, 5), 1e-4, dtype=torch.float32)
    vals[0, 0] = 1e4  # 1e4 + 9 x 1e-4: float32 cannot hold the small ones' sum beside it
    seq = torch.tensor([0.25, 3.0, 0.0], dtype=torch.float32)
    got = finalize_metrics(
        row_sums({"a/frac": frac, "a/vals": vals}, {"a/seq": seq}, num_tokens=8, num_seqs=2)
    )
    assert got["a/frac"] == int(frac.sum()) / 8
    assert got["a/vals"] == pytest.approx((1e4 + 9 * float(torch.tensor(1e-4))) / 8, rel=1e-13)
    assert got["a/seq"] == 3.25 / 2
    assert row_sums({}, {}, num_tokens=1, num_seqs=1) == {}


def test_bounds_are_strict_where_the_docs_say_so() -> None:
    """A token exactly at a TIS bound is not clipped (``rho > high``, ``rho < low``), and the veto
    drops a sequence only for a ratio strictly below its threshold: rho = 1 exactly (equal
    log-probs) against bounds of 1, and log rho = log(0.5) exactly (float64 inputs) against 0.5."""
    same = torch.full((1, 3), -1.25)
    mask = torch.ones(1, 3, dtype=torch.bool)
    sh = MismatchTensors(same, same.clone(), mask, fused=False)
    for low, high in ((0.5, 1.0), (1.0, 2.0)):
        cfg = CorrectionConfig(method="tis", tis_low=low, tis_high=high)
        got = finalize_metrics(compute_correction(cfg, sh, num_tokens=3, num_seqs=1).metrics)
        assert (got["correction/clip_frac_high"], got["correction/clip_frac_low"]) == (0.0, 0.0)
    old = torch.zeros(2, 2, dtype=torch.float64)
    roll = torch.tensor([[math.log(2.0), 0.0], [math.log(2.0) + 1e-9, 0.0]], dtype=torch.float64)
    assert float(old[0, 0] - roll[0, 0]) == math.log(0.5)
    sh = MismatchTensors(old, roll, torch.ones(2, 2, dtype=torch.bool), fused=False)
    cfg = CorrectionConfig(method="none", veto_threshold=0.5)
    w = compute_correction(cfg, sh, num_tokens=4, num_seqs=2).weights
    assert w[0].tolist() == [1.0, 1.0] and w[1].tolist() == [0.0, 0.0]  # at the threshold: kept


def test_tensor_counts_give_the_metrics_of_int_counts_down_to_one() -> None:
    """The global counts arrive as Python ints or as (all-reduced) tensors; either way a count of 1
    divides by 1 and a count of 0 by 1 (nothing to average), never by 2 or by 0."""
    old = torch.tensor([[-1.0, -2.0]])
    roll = torch.tensor([[-1.5, -2.0]])
    mask = torch.tensor([[True, False]])
    for fused in KERNELS:
        sh = MismatchTensors(old, roll, mask, fused=fused)
        for n in (1, 0):
            as_int = finalize_metrics(mismatch_metrics(sh, num_tokens=n, num_seqs=n))
            as_tensor = finalize_metrics(
                mismatch_metrics(sh, num_tokens=torch.tensor(n), num_seqs=torch.tensor(n))
            )
            assert as_int.keys() == as_tensor.keys()
            for k, v in as_int.items():
                assert as_tensor[k] == pytest.approx(v, rel=1e-12, nan_ok=True), (fused, n, k)
        one = finalize_metrics(mismatch_metrics(sh, num_tokens=torch.tensor(1), num_seqs=torch.tensor(1)))
        assert one["mismatch/kl"] == pytest.approx(-0.5, rel=1e-12)  # log mu - log pi_old of the token
        assert one["mismatch/chi2_seq"] == pytest.approx(math.exp(1.0) - 1.0, rel=1e-12)  # rho^2 = e


def test_finalize_derives_the_weight_statistics_of_every_prefix() -> None:
    """``weight_std``, ``weight_sq_mean`` and ``ess`` are derived for each prefix that has both
    partials, whatever its length; a prefix with a mean but no ``weight_dev_sq_mean`` is left alone
    and does not stop the others."""
    one = torch.tensor
    parts = {
        "a/weight_mean": one(1.5),  # no dev partial: nothing derived, and the loop goes on
        "longer_prefix/weight_mean": one(1.0),
        "longer_prefix/weight_dev_sq_mean": one(0.25),
    }
    got = finalize_metrics(parts)
    assert got["a/weight_mean"] == 1.5 and "a/weight_std" not in got
    assert got["longer_prefix/weight_std"] == 0.5 and got["longer_prefix/weight_sq_mean"] == 1.25
    assert got["longer_prefix/ess"] == pytest.approx(1.0 / 1.25, rel=1e-15)
    assert "longer_prefix/weight_dev_sq_mean" not in got
    # chi2_seq from its log: exp(v) - 1 below v = 700, +inf from there (e^700 ~ 1e304, float64's edge)
    lse = finalize_metrics({"m/chi2_seq_lse": one(699.5, dtype=torch.float64), "n/chi2_seq_lse": one(700.5)})
    assert lse["m/chi2_seq"] == pytest.approx(math.exp(699.5), rel=1e-12) and lse["n/chi2_seq"] == math.inf


def test_misuse_errors_name_the_fix() -> None:
    """The fused kernel asked for inputs it cannot take, and a method the config would have refused
    (a dataclass built in code), are errors that say what to use instead."""
    lp = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"needs 2-D float32 CPU log-probs .*correction.kernel=torch runs the PyTorch path"
    ):
        MismatchTensors(lp, lp, torch.ones(1, 2, dtype=torch.bool), fused=True)
    sh = MismatchTensors(lp, lp, torch.ones(1, 2, dtype=torch.bool), fused=False)
    bogus = dataclasses.replace(CorrectionConfig(), method="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown correction.method 'bogus'"):
        compute_correction(bogus, sh, num_tokens=2, num_seqs=1)


@FUSED
def test_acrl_weights_are_cut_at_both_bounds_and_at_one_sided_limits(fused: bool) -> None:
    """An exponent alpha * log rho beyond +-20 is cut there (weight e^-20 or e^20, counted as
    saturated), on either side; ``weight_low`` or ``weight_high`` alone clamps on its side only."""
    old = torch.tensor([[-1.0, -31.0, -1.0, -1.2]])  # log rho: 0, -30 (clamped to -20), +20, +0.2
    roll = torch.tensor([[-1.0, -1.0, -21.0, -1.4]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    adv = torch.ones(1, 4)
    sig = AcrlSignal(x=1.0, y=0.0)  # 1 - Y/X = 1: alpha = gamma * sign(A) = 2
    sh = MismatchTensors(old, roll, mask, fused=fused)
    cfg = CorrectionConfig(method="acrl", gamma=2.0)
    corr = compute_correction(cfg, sh, num_tokens=4, num_seqs=1, advantages=adv, acrl=sig)
    w = corr.weights.double()
    bound = math.exp(-20.0)
    assert w[0, 0] == 1.0 and w[0, 1] == pytest.approx(bound, rel=1e-6)
    assert w[0, 2] == pytest.approx(math.exp(20.0), rel=1e-6) and w[0, 3] == pytest.approx(
        math.exp(0.4), rel=1e-6
    )
    assert finalize_metrics(corr.metrics)["acrl/saturated_frac"] == 0.5
    for low, high, want in (
        (0.5, None, (1.0, 0.5, math.exp(20.0), math.exp(0.4))),
        (None, 1.2, (1.0, bound, 1.2, 1.2)),
    ):
        cut = dataclasses.replace(cfg, weight_low=low, weight_high=high)
        got = compute_correction(cut, sh, num_tokens=4, num_seqs=1, advantages=adv, acrl=sig).weights
        assert got.double()[0].tolist() == pytest.approx(list(want), rel=1e-6), (low, high)
