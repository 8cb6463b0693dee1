"""The fused CPU correction (correction/_fused_cpu.c) against the PyTorch path and a float64 reference.

The PyTorch path is the reference implementation (and the GPU path); the fused pass must give the
same shared sums, extrema, mismatch metrics, ACRL weights and weight metrics on every input class:
padding holding NaN/Inf, empty sequences, an empty batch, strided inputs, per-sequence Y, bounds.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from reference import ref_weights

import ckernels as native
from megatron_acrl.config import AlgorithmConfig, CorrectionConfig
from megatron_acrl.correction import (
    AcrlSignal,
    MismatchTensors,
    acrl_discrepancy_stats,
    compute_correction,
    finalize_metrics,
    fused_cpu,
    mismatch_metrics,
)
from megatron_acrl.megatron.loss_adapter import LossAdapter

pytestmark = pytest.mark.skipif(not fused_cpu.available(), reason="no C compiler: fused CPU path not built")


def batch(seed: int = 0, b: int = 7, t: int = 33, scale: float = 0.4, pad_garbage: bool = True):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 4
    lq = lp + scale * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[:, :3] = False  # prompt
    mask[1] = False  # an empty sequence
    mask[2, 5:] = True  # a long one
    lq[3, 10] = lp[3, 10] + 25.0  # a saturated log-ratio (clamped at +-20)
    if pad_garbage:  # padding may hold anything
        lp = lp.masked_fill(~mask & (torch.rand(b, t, generator=g) > 0.5), float("nan"))
        lq = lq.masked_fill(~mask & (torch.rand(b, t, generator=g) > 0.5), -float("inf"))
    adv = torch.randn(b, 1, generator=g)
    adv[4] = 0.0  # sign 0
    return lp, lq, mask, adv


def ref_seq_sums(lp: torch.Tensor, lq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 reference of MismatchTensors.seq_sums, written independently."""
    m = mask.double()
    p, q = torch.where(mask, lp.double(), 0.0), torch.where(mask, lq.double(), 0.0)
    d = p - q
    dc = d.clamp(-20, 20)
    rho = torch.exp(dc)
    rows = [
        p,
        q,
        -d,
        d,
        (torch.exp(p) - torch.exp(q)).abs() * m,
        d.abs(),
        (rho - 1 - dc) * m,
        (rho**2 - 1) * m,
        m,
    ]
    return torch.stack([r.sum(-1) for r in rows])


def test_shared_sums_and_extrema_match_float64_reference():
    lp, lq, mask, _ = batch()
    sh = MismatchTensors(lp, lq, mask, fused=True)
    ref = ref_seq_sums(lp, lq, mask)
    torch.testing.assert_close(sh.seq_sums, ref, rtol=2e-6, atol=2e-6)
    d = torch.where(mask, lp.double() - lq.double(), math.nan)
    dp = torch.where(mask, (lp.double().exp() - lq.double().exp()).abs(), math.nan)
    want = torch.stack(
        [(-d).nan_to_num(-math.inf).max(), d.nan_to_num(-math.inf).max(), dp.nan_to_num(-1).max()]
    )
    torch.testing.assert_close(sh.extremes.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_fused_equals_pytorch_path(seed):
    lp, lq, mask, _ = batch(seed)
    fused, ref = MismatchTensors(lp, lq, mask, fused=True), MismatchTensors(lp, lq, mask, fused=False)
    assert fused.fused and not ref.fused
    torch.testing.assert_close(fused.seq_sums, ref.seq_sums, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fused.extremes, ref.extremes.double(), rtol=1e-6, atol=1e-6)
    n_tok, n_seq = int(mask.sum()), int(mask.any(-1).sum())
    got = finalize_metrics(mismatch_metrics(fused, num_tokens=n_tok, num_seqs=n_seq))
    want = finalize_metrics(mismatch_metrics(ref, num_tokens=n_tok, num_seqs=n_seq))
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
    for distance in ("prob_abs", "logprob_abs", "k3"):  # the controller's statistics
        got_y = acrl_discrepancy_stats(fused, distance)
        want_y = acrl_discrepancy_stats(ref, distance)
        torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-6)
    # the rows the PyTorch branches of compute_correction use are still there, built on demand
    torch.testing.assert_close(fused.log_ratio, ref.log_ratio)
    torch.testing.assert_close(fused.pad, ref.pad)


ACRL_CASES = [
    {},
    {"per_sequence_y": True},
    {"alpha_max": 0.3},
    {"weight_low": 0.9, "weight_high": 1.1},
    {"gamma": 1.0, "distance": "k3"},
]


@pytest.mark.parametrize("overrides", ACRL_CASES, ids=lambda o: ",".join(o) or "paper")
@pytest.mark.parametrize("adv_layout", ["per_sequence", "per_token", "expanded"])
def test_acrl_weights_and_metrics_equal_pytorch_path(overrides, adv_layout):
    lp, lq, mask, adv = batch(3)
    b, t = lp.shape
    if adv_layout == "per_token":
        adv = adv.expand(b, t).clone()
        adv[0, 7] = -1.0  # token-level signs differ within a sequence
    elif adv_layout == "expanded":
        adv = adv.expand(b, t)
    cfg = dataclasses.replace(CorrectionConfig(method="acrl"), **overrides)
    sig = AcrlSignal(x=0.02, y=0.05)
    n_tok, n_seq = int(mask.sum()), int(mask.any(-1).sum())
    results = []
    for fused in (True, False):
        sh = MismatchTensors(lp, lq, mask, fused=fused)
        corr = compute_correction(cfg, sh, num_tokens=n_tok, num_seqs=n_seq, advantages=adv, acrl=sig)
        results.append((corr.weights, finalize_metrics(corr.metrics)))
    (w_f, m_f), (w_t, m_t) = results
    torch.testing.assert_close(w_f, w_t, rtol=2e-6, atol=1e-7)
    assert (w_f[~mask] == 0).all()
    # both against the float64 reference, away from the saturated sequence (the reference does not
    # clamp log rho at +-20, so that sequence's Y_i and weights differ by design)
    ok = mask & ~((lp - lq).abs() > 20).any(-1, keepdim=True)
    want = torch.tensor(ref_weights(cfg, lp, lq, ok, adv.expand(b, t), x=sig.x, y=sig.y), dtype=torch.float64)
    for w in (w_f, w_t):
        torch.testing.assert_close(w.double()[ok], want[ok], rtol=1e-5, atol=1e-6)
    assert m_f.keys() == m_t.keys()
    for k in m_t:
        assert m_f[k] == pytest.approx(m_t[k], rel=1e-5, abs=1e-7), k


def test_saturated_and_extreme_log_ratios():
    """exp/expm1 polynomials over the whole clamped range, against float64."""
    d = torch.linspace(-30, 30, 4001)
    lq = torch.full_like(d, -1.0)
    lp = lq + d
    mask = torch.ones(1, d.numel(), dtype=torch.bool)
    sh = MismatchTensors(lp[None], lq[None], mask, fused=True)
    ref = ref_seq_sums(lp[None], lq[None], mask)
    torch.testing.assert_close(sh.seq_sums, ref, rtol=3e-6, atol=1e-6)  # float32 per token
    cfg = CorrectionConfig(method="acrl", gamma=1.0)
    adv = torch.ones(1, 1)
    corr = compute_correction(
        cfg,
        sh,
        num_tokens=d.numel(),
        num_seqs=1,
        advantages=adv,
        acrl=AcrlSignal(x=1.0, y=0.0),
    )
    want = torch.exp((lp - lq).double().clamp(-20, 20))  # alpha = 1; log rho is float32 on both paths
    torch.testing.assert_close(corr.weights[0].double(), want, rtol=4e-7, atol=0)  # ~3 ulp of float32


def test_empty_batch_and_all_padding():
    for b, t in ((0, 5), (3, 0), (2, 4)):
        lp, lq = torch.zeros(b, t), torch.zeros(b, t)
        mask = torch.zeros(b, t, dtype=torch.bool)
        sh = MismatchTensors(lp, lq, mask, fused=True)
        got = finalize_metrics(mismatch_metrics(sh, num_tokens=0, num_seqs=0))
        want = finalize_metrics(
            mismatch_metrics(MismatchTensors(lp, lq, mask, fused=False), num_tokens=0, num_seqs=0)
        )
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], nan_ok=True), (b, t, k)
        corr = compute_correction(
            CorrectionConfig(method="acrl"), sh, num_tokens=0, num_seqs=0,
            advantages=torch.ones(b, 1), acrl=AcrlSignal(x=0.1, y=0.1),
        )  # fmt: skip
        m = finalize_metrics(corr.metrics)
        assert corr.weights.shape == (b, t) and m["correction/weight_mean"] == 0.0
        assert math.isnan(m["correction/weight_max"]) and math.isnan(m["correction/weight_min"])


def test_strided_inputs():
    lp, lq, mask, adv = batch(5, pad_garbage=False)
    wide = torch.zeros(lp.shape[0], 2 * lp.shape[1])
    wide[:, ::2] = lp  # non-unit stride along T: copied to rows first
    sh = MismatchTensors(wide[:, ::2], lq.t().contiguous().t(), mask, fused=True)
    torch.testing.assert_close(
        sh.seq_sums, MismatchTensors(lp, lq, mask, fused=False).seq_sums, rtol=1e-5, atol=1e-4
    )


def test_paths_that_stay_in_pytorch():
    lp, lq, mask, adv = batch(1)
    with pytest.raises(ValueError, match="float32 CPU"):
        MismatchTensors(lp.double(), lq.double(), mask, fused=True)
    assert not MismatchTensors(lp.double(), lq.double(), mask, fused=False).fused  # float64: the exact path
    sh = MismatchTensors(lp, lq, mask, fused=True)
    assert sh.fused
    # masks / veto / batch normalisation: ACRL's PyTorch branch on the fused sums
    for extra in ({"masks": ("seq_mis",)}, {"veto_threshold": 1e-4}, {"batch_normalize": True}):
        cfg = dataclasses.replace(CorrectionConfig(method="acrl"), **extra)
        kw = dict(num_tokens=int(mask.sum()), num_seqs=6, advantages=adv, acrl=AcrlSignal(x=0.02, y=0.05))
        got = compute_correction(cfg, sh, **kw)
        want = compute_correction(cfg, MismatchTensors(lp, lq, mask, fused=False), **kw)
        torch.testing.assert_close(got.weights, want.weights, rtol=2e-6, atol=1e-7)


def test_kernel_is_chosen_once_from_the_config_and_the_device():
    """correction.kernel, resolved where the loss adapter is built; the math never looks at the device."""
    assert fused_cpu.resolve_kernel("auto", "cpu") and fused_cpu.resolve_kernel("fused_cpu", "cpu")
    assert not fused_cpu.resolve_kernel("auto", "cuda") and not fused_cpu.resolve_kernel("torch", "cpu")
    with pytest.raises(ValueError, match=r"correction\.kernel=fused_cpu runs on CPU tensors only"):
        fused_cpu.resolve_kernel("fused_cpu", "cuda")
    with pytest.raises(ValueError, match="correction.kernel must be one of auto, torch, fused_cpu"):
        fused_cpu.resolve_kernel("c", "cpu")

    def adapter(kernel: str, device: str = "cpu") -> LossAdapter:
        correction = dataclasses.replace(CorrectionConfig(), kernel=kernel)
        return LossAdapter(
            algorithm=AlgorithmConfig(), correction=correction, tp_group=None, vocab_size=8, device=device
        )

    assert adapter("auto").fused and adapter("fused_cpu").fused
    assert not adapter("torch").fused and not adapter("auto", "cuda").fused
    with pytest.raises(ValueError, match="correction.kernel=fused_cpu"):
        adapter("fused_cpu", "cuda")


def test_fused_cpu_kernel_is_refused_when_the_library_does_not_build(monkeypatch):
    monkeypatch.setattr(fused_cpu, "available", lambda: False)
    assert not fused_cpu.resolve_kernel("auto", "cpu")  # auto falls back to the PyTorch path
    with pytest.raises(
        ValueError, match=r"correction\.kernel=fused_cpu: _fused_cpu\.c did not build.*kernel=auto"
    ):
        fused_cpu.resolve_kernel("fused_cpu", "cpu")


def test_native_build_is_cached_and_reports_compiler_errors(tmp_path):
    src = tmp_path / "k.c"
    src.write_text("int answer(void) { return 42; }\n")
    lib = native.build(src, tmp_path / "cache")
    assert native.build(src, tmp_path / "cache") == lib  # cached by content
    src.write_text("int answer(void) { return 41; }\n")
    assert native.build(src, tmp_path / "cache") != lib  # a changed source is rebuilt
    src.write_text("int answer(void) { return }\n")
    with pytest.raises(RuntimeError, match="compiling k.c failed"):
        native.build(src, tmp_path / "cache")
