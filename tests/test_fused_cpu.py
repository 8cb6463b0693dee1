"""The fused CPU correction (correction/_fused_cpu.c) against the independent float64 reference
(tests/reference.py) and the PyTorch path.

Both kernels must give the reference's shared sums, extrema, mismatch metrics, ACRL weights, weight
metrics and controller statistics, and each other's, on every input class: padding holding NaN/Inf,
non-finite log-probs on valid tokens, empty sequences, an empty batch, strided inputs, saturated
log-ratios, per-sequence Y, bounds.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from reference import (
    counts,
    ref_correction,
    ref_mismatch,
    ref_seq_discrepancy,
    ref_weights,
    token_distance,
    valid_tokens,
)

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
    """float64 reference of ``MismatchTensors.seq_sums`` (its 10 rows), loops over the valid tokens."""
    p, q, m = lp.tolist(), lq.tolist(), mask.tolist()
    toks = valid_tokens(lp, lq, mask)
    rows = torch.zeros(10, len(p), dtype=torch.float64)
    for i, ts in enumerate(toks):
        for t in ts:
            d = p[i][t] - q[i][t]
            dc = max(-20.0, min(20.0, d))
            vals = (p[i][t], q[i][t], -d, d, abs(math.exp(p[i][t]) - math.exp(q[i][t])), abs(d),
                    token_distance(p[i][t], q[i][t], "k3"), math.exp(2 * dc) - 1.0, 1.0, 0.0)  # fmt: skip
            rows[:, i] += torch.tensor(vals, dtype=torch.float64)
        rows[9, i] = sum(1 for t in range(len(m[i])) if m[i][t]) - len(ts)
    return rows


def _metrics(sh, lp, lq, mask):
    n_tok, n_seq = counts(lp, lq, mask)
    return finalize_metrics(mismatch_metrics(sh, num_tokens=n_tok, num_seqs=n_seq))


def _assert_reference_metrics(got: dict, lp, lq, mask, rel=1e-5, abs_=1e-6):
    want = ref_mismatch(lp, lq, mask)
    assert {k[len("mismatch/") :] for k in got} == set(want)
    for k, v in want.items():
        assert got["mismatch/" + k] == pytest.approx(v, rel=rel, abs=abs_, nan_ok=True), k


def test_shared_sums_and_extrema_match_float64_reference():
    lp, lq, mask, _ = batch()
    sh = MismatchTensors(lp, lq, mask, fused=True)
    torch.testing.assert_close(sh.seq_sums, ref_seq_sums(lp, lq, mask), rtol=2e-6, atol=2e-6)
    want = ref_mismatch(lp, lq, mask)
    assert sh.extremes[0].item() == pytest.approx(-want["log_ratio_min"], rel=1e-6)
    assert sh.extremes[1].item() == pytest.approx(want["log_ratio_max"], rel=1e-6)
    assert sh.extremes[2].item() == pytest.approx(want["prob_abs_diff_max"], rel=1e-6)
    torch.testing.assert_close(sh.mask, mask)  # the valid tokens (the padding holds NaN/-inf)


@pytest.mark.parametrize("seed", range(4))
def test_fused_equals_pytorch_path(seed):
    lp, lq, mask, _ = batch(seed)
    fused, ref = MismatchTensors(lp, lq, mask, fused=True), MismatchTensors(lp, lq, mask, fused=False)
    assert fused.fused and not ref.fused
    torch.testing.assert_close(fused.seq_sums, ref.seq_sums, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fused.extremes, ref.extremes, rtol=1e-6, atol=1e-6)
    got, want = _metrics(fused, lp, lq, mask), _metrics(ref, lp, lq, mask)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
    for m in (got, want):  # both against the float64 reference
        _assert_reference_metrics(m, lp, lq, mask)
    for distance in ("prob_abs", "logprob_abs", "k3"):  # the controller's statistics
        ys = ref_seq_discrepancy(lp, lq, mask, distance)
        for sh in (fused, ref):
            total, count = acrl_discrepancy_stats(sh, distance).tolist()
            assert count == len(ys) and total == pytest.approx(sum(ys), rel=1e-5), distance
    # the rows the PyTorch branches of compute_correction use are still there, built on demand
    torch.testing.assert_close(fused.log_ratio, ref.log_ratio)
    torch.testing.assert_close(fused.pad, ref.pad)


ACRL_CASES = [
    {},
    {"per_sequence_y": True},
    {"alpha_max": 0.3},
    {"alpha_min": 0.0},  # sign-safe ACRL (issue #34)
    {"alpha_min": 0.0, "alpha_max": 0.3},
    {"alpha_min": -0.1, "alpha_max": 0.5, "per_sequence_y": True},
    {"weight_low": 0.9, "weight_high": 1.1},
    {"gamma": 1.0, "distance": "k3"},
    {"gamma": 3.0},  # saturates the weights of the +25 token
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
    w_ref, m_ref = ref_correction(cfg, lp, lq, mask, adv.expand(b, t), x=sig.x, y=sig.y)
    want = torch.tensor(w_ref, dtype=torch.float64)
    for w in (w_f, w_t):  # both against the float64 reference (saturation at e^+-20 included)
        torch.testing.assert_close(w.double(), want, rtol=1e-5, atol=1e-6)
    assert m_f.keys() == m_t.keys() == set(m_ref) | {"correction/weight_sq_mean"}
    for k, v in m_ref.items():
        for m in (m_f, m_t):
            assert m[k] == pytest.approx(v, rel=2e-5, abs=1e-7), k
    if cfg.gamma == 3.0:
        assert m_f["acrl/saturated_frac"] > 0


def test_a_nan_advantage_has_no_sign_on_either_kernel():
    """sign(NaN) is 0 (the reference's, the C loop's, torch.sign's): on padding it reaches no weight
    or metric (the PyTorch path masks alpha by a product now, not a where), on a valid token its
    weight is rho^0 = 1."""
    lp, lq, mask, adv = batch(5)
    b, t = lp.shape
    adv = adv.expand(b, t).clone()
    pad_at = (~mask).nonzero()[0]
    adv[pad_at[0], pad_at[1]] = math.nan
    valid_at = mask.nonzero()[3]
    adv[valid_at[0], valid_at[1]] = math.nan
    cfg = CorrectionConfig(method="acrl")
    sig = AcrlSignal(x=0.02, y=0.05)
    n_tok = int(mask.sum())
    w_ref, m_ref = ref_correction(cfg, lp, lq, mask, adv, x=sig.x, y=sig.y)
    for fused in (True, False):
        sh = MismatchTensors(lp, lq, mask, fused=fused)
        corr = compute_correction(cfg, sh, num_tokens=n_tok, num_seqs=b, advantages=adv, acrl=sig)
        torch.testing.assert_close(
            corr.weights.double(), torch.tensor(w_ref, dtype=torch.float64), rtol=1e-5, atol=1e-6
        )
        assert corr.weights[valid_at[0], valid_at[1]].item() == 1.0
        got = finalize_metrics(corr.metrics)
        for k, v in m_ref.items():
            assert got[k] == pytest.approx(v, rel=2e-5, abs=1e-7), (fused, k)


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
    want = torch.tensor(ref_weights(cfg, lp[None], lq[None], mask, adv.expand(1, d.numel()), x=1.0, y=0.0))
    torch.testing.assert_close(corr.weights.double(), want.double(), rtol=4e-7, atol=0)  # ~3 ulp of float32


# Every edge a long run meets, as (name, log pi_old, log mu, mask): both kernels against the reference.
_Q = [[-0.7, -1.3, -2.0, -0.2, -3.0], [-0.5, -0.9, -1.1, -4.0, -0.05]]
_M = [[True, True, True, True, False], [True, True, True, False, False]]
_P = [[-0.6, -1.2, -2.1, -0.3, 0.0], [-0.4, -1.0, -1.0, 0.0, 0.0]]
_NAN, _INF = float("nan"), math.inf
EDGES = [
    ("nan_old_on_a_valid_token", [[-0.6, _NAN, -2.1, -0.3, 0.0], _P[1]], _Q, _M),
    ("inf_mu_on_a_valid_token", _P, [[-0.7, -1.3, -_INF, -0.2, -3.0], [-0.5, _INF, -1.1, -4.0, -0.05]], _M),
    ("a_whole_sequence_non_finite", [[_NAN] * 4 + [0.0], _P[1]], _Q, _M),
    ("nan_and_inf_in_padding", [[-0.6, -1.2, -2.1, -0.3, _NAN], [-0.4, -1.0, -1.0, _INF, -_INF]], _Q, _M),
    ("saturated_log_ratios", [[-0.7, -1.2, -2.1, -0.3, 0.0], [-30.0, -1.0, -1.0, 0.0, 0.0]],
     [[-26.0, -1.3, -2.0, -0.2, -3.0], [-0.5, -0.9, -1.1, -4.0, -0.05]], _M),
    ("identical", _Q, _Q, _M),
    ("tiny_log_ratios", [[q + 1e-6 for q in row] for row in _Q], _Q, _M),
    ("one_token", _Q, [[q - 0.3 for q in row] for row in _Q], [[0, 0, 1, 0, 0], [0] * 5]),
    ("all_padding", _Q, _Q, [[False] * 5, [False] * 5]),
]  # fmt: skip


@pytest.mark.parametrize("edge", EDGES, ids=[e[0] for e in EDGES])
@pytest.mark.parametrize("method", ["acrl", "tis", "seq_tis", "icepop", "geo_mis"])
def test_every_edge_case_on_both_kernels_against_the_reference(edge, method):
    """Both kernels give the reference's metrics, weights and Y on each edge: non-finite log-probs on
    valid tokens are dropped and counted, padding never matters, empty means NaN, not -1 or inf."""
    _, p, q, m = edge
    lp, lq, mask = torch.tensor(p), torch.tensor(q), torch.tensor(m, dtype=torch.bool)
    adv = torch.tensor([[1.0], [-0.5]]).expand(2, 5)
    cfg = CorrectionConfig(method=method, gamma=1.5, geo_low=0.5, geo_high=2.0)
    sig = AcrlSignal(x=0.05, y=0.2)
    n_tok, n_seq = counts(lp, lq, mask)
    w_ref, m_ref = ref_correction(cfg, lp, lq, mask, adv, x=sig.x, y=sig.y)
    for fused in (True, False):
        sh = MismatchTensors(lp, lq, mask, fused=fused)
        _assert_reference_metrics(_metrics(sh, lp, lq, mask), lp, lq, mask)
        corr = compute_correction(cfg, sh, num_tokens=n_tok, num_seqs=n_seq, advantages=adv, acrl=sig)
        torch.testing.assert_close(corr.weights.double(), torch.tensor(w_ref, dtype=torch.float64), rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
        got = finalize_metrics(corr.metrics)
        for k, v in m_ref.items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6, nan_ok=True), (fused, k)
        total, count = acrl_discrepancy_stats(sh, "prob_abs").tolist()
        ys = ref_seq_discrepancy(lp, lq, mask, "prob_abs")
        assert count == len(ys) and total == pytest.approx(sum(ys), rel=1e-5)


def test_empty_batch_and_all_padding():
    for b, t in ((0, 5), (3, 0), (2, 4)):
        lp, lq = torch.zeros(b, t), torch.zeros(b, t)
        mask = torch.zeros(b, t, dtype=torch.bool)
        for fused in (True, False):
            sh = MismatchTensors(lp, lq, mask, fused=fused)
            got = finalize_metrics(mismatch_metrics(sh, num_tokens=0, num_seqs=0))
            _assert_reference_metrics(got, lp, lq, mask)
            assert math.isnan(got["mismatch/chi2_seq"]) and math.isnan(got["mismatch/log_ppl_diff_max"])
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
    torch.testing.assert_close(sh.seq_sums, ref_seq_sums(lp, lq, mask), rtol=2e-6, atol=2e-6)
    _assert_reference_metrics(_metrics(sh, lp, lq, mask), lp, lq, mask)


def test_a_mask_of_any_dtype_reads_as_its_nonzero_entries():
    """The response mask may come as bool, 0/1 floats or integers (a trainer's attention mask): on
    both kernels every dtype gives the bool mask's metrics and weights exactly."""
    lp, lq, mask, adv = batch(6, pad_garbage=False)
    cfg = CorrectionConfig(method="acrl")
    sig = AcrlSignal(x=0.02, y=0.05)
    for fused in (False, True):
        want = None
        for m in (mask, mask.to(torch.float32), mask.to(torch.int64), mask.to(torch.float64) * 1.0):
            sh = MismatchTensors(lp, lq, m, fused=fused)
            corr = compute_correction(
                cfg, sh, num_tokens=int(mask.sum()), num_seqs=4, advantages=adv, acrl=sig
            )
            got = (
                corr.weights,
                finalize_metrics({**corr.metrics, **mismatch_metrics(sh, num_tokens=9, num_seqs=4)}),
            )
            if want is None:
                want = got
                continue
            assert torch.equal(got[0], want[0]) and got[1] == want[1], (fused, m.dtype)


def test_paths_that_stay_in_pytorch():
    lp, lq, mask, adv = batch(1)
    with pytest.raises(ValueError, match="float32 CPU"):
        MismatchTensors(lp.double(), lq.double(), mask, fused=True)
    assert not MismatchTensors(lp.double(), lq.double(), mask, fused=False).fused  # float64: the exact path
    sh = MismatchTensors(lp, lq, mask, fused=True)
    assert sh.fused
    # masks / veto / batch normalisation: ACRL's PyTorch branch on the fused sums
    for extra in ({"masks": ("seq_mis",)}, {"veto_threshold": 1e-4}, {"batch_normalize": True}):
        cfg = dataclasses.replace(CorrectionConfig(method="acrl", seq_low=0.2, seq_high=5.0), **extra)
        kw = dict(num_tokens=int(mask.sum()), num_seqs=6, advantages=adv, acrl=AcrlSignal(x=0.02, y=0.05))
        got = compute_correction(cfg, sh, **kw)
        want = compute_correction(cfg, MismatchTensors(lp, lq, mask, fused=False), **kw)
        torch.testing.assert_close(got.weights, want.weights, rtol=2e-6, atol=1e-7)
        w_ref = ref_weights(cfg, lp, lq, mask, adv.expand_as(lp), x=0.02, y=0.05)
        torch.testing.assert_close(
            got.weights.double(), torch.tensor(w_ref, dtype=torch.float64), rtol=1e-5, atol=1e-6
        )


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
    with pytest.raises(ValueError) as err:
        fused_cpu.resolve_kernel("fused_cpu", "cpu")
    assert str(err.value) == (
        "correction.kernel=fused_cpu: _fused_cpu.c did not build (the log says why; a C compiler is needed: "
        "install gcc or set $CC); set correction.kernel=auto (or torch) to use the PyTorch path"
    )
    with pytest.raises(ValueError) as err:
        fused_cpu.resolve_kernel("fused_cpu", "cuda:1")
    assert str(err.value) == (
        "correction.kernel=fused_cpu runs on CPU tensors only, but the trainer runs on cuda:1; "
        "set correction.kernel=auto (or torch)"
    )


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


def test_acrl_weights_pass_reads_every_advantage_layout_and_coefficient_dtype():
    """The C pass called directly: ``[B]``, ``[B, 1]`` and ``[B, T]`` advantages of any float dtype,
    with token signs that change inside a sequence, and a per-sequence coefficient in float32 or
    float64, all give the weights of the float64 reference; a shape that does not match is refused."""
    lp, lq, mask, adv = batch(5, pad_garbage=False)
    b, t = lp.shape
    tok = adv.expand(b, t).clone()
    tok[:, 1::2] *= -1.0  # every other token flips its sign
    coef = torch.linspace(-0.8, 0.6, b, dtype=torch.float64)
    n_tok = int(mask.sum())
    cfg = CorrectionConfig(method="acrl")
    kw = {"alpha_max": None, "weight_low": None, "weight_high": None, "num_tokens": n_tok}
    for a, want_adv in ((adv.squeeze(-1).double(), adv.expand(b, t)), (adv, adv.expand(b, t)), (tok, tok)):
        for c in (coef, coef.float(), 0.3):
            w, means, _ = fused_cpu.acrl_weights(lp, lq, mask, a, c, **kw)
            cc = c.tolist() if isinstance(c, torch.Tensor) else [c] * b
            sl = [slice(i, i + 1) for i in range(b)]
            ref = [
                ref_weights(cfg, lp[s], lq[s], mask[s], want_adv[s], coef=cc[i])[0] for i, s in enumerate(sl)
            ]
            assert w.dtype == torch.float32
            torch.testing.assert_close(
                w.double(), torch.tensor(ref, dtype=torch.float64), rtol=1e-5, atol=1e-6
            )
            assert means[0].item() == pytest.approx(sum(map(sum, ref)) / n_tok, rel=1e-5)
    for bad in (adv[:-1], torch.zeros(b, t + 1), torch.zeros(b, 2)):
        with pytest.raises(ValueError) as err:
            fused_cpu.acrl_weights(lp, lq, mask, bad, 0.3, **kw)
        assert str(err.value) == f"advantages of shape {tuple(bad.shape)} do not match log-probs [{b}, {t}]"
