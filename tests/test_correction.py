"""Mismatch metrics and correction weights against the float64 reference (tests/reference.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ref_mismatch, ref_seq_discrepancy, ref_weights

from megatron_acrl.config import CorrectionConfig
from megatron_acrl.correction import (
    AcrlSignal,
    acrl_discrepancy_stats,
    combine_partials,
    compute_correction,
    finalize_metrics,
    mismatch_metrics,
    sequence_discrepancy,
)

METHODS = ["none", "tis", "seq_tis", "seq_mis", "geo_mis", "icepop", "acrl"]


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


def test_mismatch_metrics_match_reference():
    lp, lq, mask, _ = make_batch()
    n_tok, n_seq = counts(mask)
    got = finalize_metrics(mismatch_metrics(lp, lq, mask, num_tokens=n_tok, num_seqs=n_seq))
    want = ref_mismatch(lp, lq, mask)
    for k, v in want.items():
        assert got["mismatch/" + k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_mismatch_metrics_float64_exact():
    lp, lq, mask, _ = make_batch(dtype=torch.float64)
    n_tok, n_seq = counts(mask)
    got = finalize_metrics(mismatch_metrics(lp, lq, mask, num_tokens=n_tok, num_seqs=n_seq))
    for k, v in ref_mismatch(lp, lq, mask).items():
        assert got["mismatch/" + k] == pytest.approx(v, rel=1e-12, abs=1e-12), k


def test_chi2_seq_does_not_overflow():
    # prod rho = e^400 per sequence: exp(2 * 400) overflows float32 and float64 alike.
    b, t = 3, 40
    lp = torch.zeros(b, t)
    lq = torch.full((b, t), -10.0)
    mask = torch.ones(b, t, dtype=torch.bool)
    parts = mismatch_metrics(lp, lq, mask, num_tokens=b * t, num_seqs=b)
    assert parts["mismatch/chi2_seq_lse"].item() == pytest.approx(800.0, rel=1e-6)
    assert math.isinf(finalize_metrics(parts)["mismatch/chi2_seq"])
    lq2 = torch.full((b, t), -0.5)  # moderate: exact value e^(2*20) - 1
    out = finalize_metrics(mismatch_metrics(lp, lq2, mask, num_tokens=b * t, num_seqs=b))
    assert out["mismatch/chi2_seq"] == pytest.approx(math.exp(40) - 1, rel=1e-5)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "extra", [{}, {"masks": ("seq_mis",)}, {"veto_threshold": 0.6}, {"masks": ("geo_mis",)}]
)
def test_weights_match_reference(method, extra):
    lp, lq, mask, adv = make_batch(seed=3, scale=0.15)
    cfg = CorrectionConfig(method=method, geo_low=0.9, geo_high=1.1, **extra)
    n_tok, n_seq = counts(mask)
    sig = AcrlSignal(x=0.05, y=0.08)
    corr = compute_correction(cfg, lp, lq, mask, num_tokens=n_tok, num_seqs=n_seq, advantages=adv, acrl=sig)
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
        {"weight_low": 0.9, "weight_high": 1.05},
        {"distance": "logprob_abs", "per_sequence_y": True},
        {"distance": "k3", "per_sequence_y": True},
    ],
)
def test_acrl_extensions_match_reference(overrides):
    lp, lq, mask, adv = make_batch(seed=5, scale=0.2)
    cfg = CorrectionConfig(method="acrl", gamma=1.3, **overrides)
    n_tok, n_seq = counts(mask)
    corr = compute_correction(
        cfg, lp, lq, mask, num_tokens=n_tok, num_seqs=n_seq, advantages=adv, acrl=AcrlSignal(x=0.02, y=0.05)
    )
    want = torch.tensor(ref_weights(cfg, lp, lq, mask, adv, x=0.02, y=0.05), dtype=torch.float64)
    torch.testing.assert_close(corr.weights.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("distance", ["prob_abs", "logprob_abs", "k3"])
def test_sequence_discrepancy_matches_reference(distance):
    lp, lq, mask, _ = make_batch(seed=7, dtype=torch.float64)
    y, valid = sequence_discrepancy(lp, lq, mask, distance)
    want = ref_seq_discrepancy(lp, lq, mask, distance)
    torch.testing.assert_close(y[valid], torch.tensor(want, dtype=torch.float64))
    stats = acrl_discrepancy_stats(lp, lq, mask, distance)
    assert stats[1].item() == len(want)
    assert stats[0].item() == pytest.approx(sum(want))


def test_acrl_direction():
    """Y > X with A > 0: tokens the trainer likes more than the engine (rho > 1) are down-weighted."""
    lp = torch.tensor([[-0.1, -0.2]])
    lq = torch.tensor([[-0.5, -0.6]])  # rho > 1
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.ones(1, 2)
    cfg = CorrectionConfig(method="acrl")
    pull = compute_correction(
        cfg, lp, lq, mask, num_tokens=2, num_seqs=1, advantages=adv, acrl=AcrlSignal(x=0.1, y=0.2)
    ).weights
    push = compute_correction(
        cfg, lp, lq, mask, num_tokens=2, num_seqs=1, advantages=adv, acrl=AcrlSignal(x=0.2, y=0.1)
    ).weights
    assert (pull < 1).all() and (push > 1).all()
    neg = compute_correction(
        cfg, lp, lq, mask, num_tokens=2, num_seqs=1, advantages=-adv, acrl=AcrlSignal(x=0.1, y=0.2)
    ).weights
    assert (neg > 1).all()  # sign(A) flips the direction


def test_acrl_requires_signal():
    lp, lq, mask, adv = make_batch()
    with pytest.raises(ValueError, match="AcrlSignal"):
        compute_correction(CorrectionConfig(method="acrl"), lp, lq, mask, num_tokens=1, num_seqs=1)


def test_fractions_and_veto_counts():
    lp = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    lq = torch.tensor([[-1.5, 0.0, 2.0], [0.0, -12.0, 0.0]])  # rho = e^1.5, 1, e^-2 / 1, e^12, 1
    mask = torch.ones(2, 3, dtype=torch.bool)
    fin = finalize_metrics(
        compute_correction(CorrectionConfig(method="tis"), lp, lq, mask, num_tokens=6, num_seqs=2).metrics
    )
    assert fin["correction/clip_frac_high"] == pytest.approx(2 / 6)
    assert fin["correction/clip_frac_low"] == 0.0
    fin = finalize_metrics(
        compute_correction(CorrectionConfig(method="icepop"), lp, lq, mask, num_tokens=6, num_seqs=2).metrics
    )
    assert fin["correction/mask_frac_high"] == pytest.approx(1 / 6)
    assert fin["correction/mask_frac_low"] == pytest.approx(1 / 6)
    lq_v = torch.tensor([[0.0, 0.0, 10.0], [0.0, 0.0, 0.0]])  # rho = e^-10 < 1e-4 in sequence 0
    corr = compute_correction(
        CorrectionConfig(method="none", veto_threshold=1e-4), lp, lq_v, mask, num_tokens=6, num_seqs=2
    )
    assert corr.weights[0].sum() == 0 and (corr.weights[1] == 1).all()
    assert finalize_metrics(corr.metrics)["correction/seq_veto_frac"] == pytest.approx(0.5)


def test_batch_normalize():
    lp, lq, mask, adv = make_batch(seed=11)
    n_tok, n_seq = counts(mask)
    corr = compute_correction(
        CorrectionConfig(method="tis", batch_normalize=True), lp, lq, mask, num_tokens=n_tok, num_seqs=n_seq
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
@given(batches(), st.sampled_from(METHODS))
def test_pi_equals_mu_gives_unit_weights_and_zero_divergence(batch, method):
    lp, _, mask, adv = batch
    n_tok, n_seq = counts(mask)
    corr = compute_correction(
        CorrectionConfig(method=method),
        lp,
        lp.clone(),
        mask,
        num_tokens=n_tok,
        num_seqs=n_seq,
        advantages=adv,
        acrl=AcrlSignal(x=0.1, y=0.3),
    )
    assert torch.equal(corr.weights, mask.float())
    fin = finalize_metrics(mismatch_metrics(lp, lp, mask, num_tokens=n_tok, num_seqs=n_seq))
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
@given(batches(), st.floats(0.0, 0.9), st.floats(1.0, 5.0))
def test_tis_weights_never_exceed_clip(batch, low, high):
    lp, lq, mask, _ = batch
    cfg = CorrectionConfig(method="tis", tis_low=low, tis_high=high)
    w = compute_correction(cfg, lp, lq, mask, num_tokens=1, num_seqs=1).weights
    assert (w[mask] <= high + 1e-6).all() and (w[mask] >= low - 1e-6).all()
    assert (w[~mask] == 0).all()


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(METHODS), st.integers(1, 4))
def test_padding_never_changes_a_result(batch, method, pad):
    lp, lq, mask, adv = batch
    n_tok, n_seq = counts(mask)
    cfg = CorrectionConfig(method=method, veto_threshold=1e-3)
    sig = AcrlSignal(x=0.1, y=0.2)
    base = compute_correction(cfg, lp, lq, mask, num_tokens=n_tok, num_seqs=n_seq, advantages=adv, acrl=sig)
    b = lp.shape[0]
    junk = torch.full((b, pad), float("nan"))
    lp2, lq2 = torch.cat([lp, junk], 1), torch.cat([lq, -junk.nan_to_num(nan=-1e30)], 1)
    mask2 = torch.cat([mask, torch.zeros(b, pad, dtype=torch.bool)], 1)
    adv2 = torch.cat([adv, torch.full((b, pad), 5.0)], 1)
    # Also garbage inside the original padding positions.
    lp2 = torch.where(mask2, lp2, torch.tensor(float("inf")))
    padded = compute_correction(
        cfg, lp2, lq2, mask2, num_tokens=n_tok, num_seqs=n_seq, advantages=adv2, acrl=sig
    )
    torch.testing.assert_close(padded.weights[:, : lp.shape[1]], base.weights)
    assert (padded.weights[:, lp.shape[1] :] == 0).all()
    a = finalize_metrics({**base.metrics, **mismatch_metrics(lp, lq, mask, num_tokens=n_tok, num_seqs=n_seq)})
    c = finalize_metrics(
        {**padded.metrics, **mismatch_metrics(lp2, lq2, mask2, num_tokens=n_tok, num_seqs=n_seq)}
    )
    assert a.keys() == c.keys()
    for k in a:
        assert c[k] == pytest.approx(a[k], rel=1e-6, abs=1e-7, nan_ok=True), k


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(METHODS), st.data())
def test_micro_batch_split_with_global_denominators_is_exact(batch, method, data):
    lp, lq, mask, adv = batch
    n_tok, n_seq = counts(mask)
    cfg = CorrectionConfig(method=method, masks=("seq_mis",) if method == "acrl" else ())
    sig = AcrlSignal(x=0.1, y=0.2)

    def run(sl):
        corr = compute_correction(
            cfg, lp[sl], lq[sl], mask[sl], num_tokens=n_tok, num_seqs=n_seq, advantages=adv[sl], acrl=sig
        )
        return {
            **corr.metrics,
            **mismatch_metrics(lp[sl], lq[sl], mask[sl], num_tokens=n_tok, num_seqs=n_seq),
        }

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
