"""Policy/value/KL losses against the independent float64 reference (tests/reference.py): values,
hand-derived gradients, invariances.

Every comparison here is with :func:`reference.ref_rl_loss` (explicit loops, the gradient written
out by hand) or with numbers worked out by hand; none compares the package with itself only. The
batches spread pi / pi_old over both PPO clip bands, so swapped clip bounds or a wrong Dr. GRPO
denominator fail them (``tests/test_planted_bugs.py`` plants both and checks).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import counts as valid_counts
from reference import ref_rl_loss, ref_weights
from test_correction import KERNELS, batches, make_batch

from megatron_acrl.algo.losses import RLLoss, aggregate, kl_penalty, ppo_policy_loss, rl_loss, value_loss
from megatron_acrl.config import AlgorithmConfig, CorrectionConfig
from megatron_acrl.correction import (
    AcrlSignal,
    MismatchTensors,
    batch_weight_mean,
    combine_partials,
    finalize_metrics,
)

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
SIG = AcrlSignal(x=0.05, y=0.09)


def new_logprobs(lp, seed=1, scale=0.3):
    """log pi: log pi_old moved by N(0, scale^2), so pi / pi_old spans both clip bands."""
    g = torch.Generator().manual_seed(seed)
    return (lp + scale * torch.randn(lp.shape, generator=g, dtype=lp.dtype)).clone()


def _loss(x, lp_old, lq, adv, mask, alg, cfg, *, fused=False, acrl=SIG, entropy=None, ref=None, **kw):
    n_tok, n_seq = valid_counts(lp_old, lq, mask)
    return rl_loss(
        x, lp_old, lq, adv, mask, algorithm=alg, correction=cfg, acrl=acrl, num_tokens=n_tok, num_seqs=n_seq,
        fused=fused, entropy=entropy, ref_logprobs=ref, **kw,
    )  # fmt: skip


def _reference(x, lp_old, lq, adv, mask, alg, cfg, *, acrl=SIG, entropy=None, ref=None, weight_mean=None):
    w = ref_weights(cfg, lp_old, lq, mask, adv, x=acrl.x, y=acrl.y, weight_mean=weight_mean)
    return ref_rl_loss(
        x.detach(), lp_old, lq, adv, mask, w, agg=alg.loss_agg, clip_low=alg.clip_low,
        clip_high=alg.clip_high, dual_clip=alg.dual_clip, norm_len=alg.loss_norm_len, kl_coef=alg.kl_coef,
        kl_type=alg.kl_type, ref_lp=ref, entropy=entropy, entropy_coef=alg.entropy_coef,
    )  # fmt: skip


def _assert_matches(loss, grads, want, *, rel):
    value, g_ref, gh_ref = want
    assert loss.item() == pytest.approx(value, rel=rel, abs=rel * 1e-2)
    torch.testing.assert_close(
        grads[0].double(), torch.tensor(g_ref, dtype=torch.float64), rtol=rel, atol=rel * 1e-2
    )
    if len(grads) > 1:
        torch.testing.assert_close(
            grads[1].double(), torch.tensor(gh_ref, dtype=torch.float64), rtol=rel, atol=1e-12
        )


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("method", ["none", "tis", "seq_mis", "icepop", "acrl"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_rl_loss_matches_reference_value_and_grad(agg, method, dual_clip):
    lp_old, lq, mask, adv = make_batch(seed=2, scale=0.2, dtype=torch.float64)
    alg = AlgorithmConfig(loss_agg=agg, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, loss_norm_len=9)
    cfg = CorrectionConfig(method=method)
    x = new_logprobs(lp_old).requires_grad_()
    loss, _ = _loss(x, lp_old, lq, adv, mask, alg, cfg)
    (g,) = torch.autograd.grad(loss, x)
    _assert_matches(loss, (g,), _reference(x, lp_old, lq, adv, mask, alg, cfg), rel=1e-10)
    assert (g[~mask] == 0).all()


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_gradcheck_policy_kl_entropy(agg, kl_type):
    """The whole loss (clipped surrogate, KL to a reference model, entropy bonus) against the
    reference's hand-written gradient, where pi / pi_old spans both clip bands; and, where the
    surrogate is smooth, against finite differences."""
    lp_old, lq, mask, adv = make_batch(seed=4, b=5, t=7, dtype=torch.float64)
    ref = (
        lp_old
        - 0.1
        + 0.05 * torch.randn(lp_old.shape, generator=torch.Generator().manual_seed(5), dtype=lp_old.dtype)
    )
    alg = AlgorithmConfig(
        loss_agg=agg,
        kl_coef=0.3,
        kl_type=kl_type,
        entropy_coef=0.01,
        loss_norm_len=4,
        clip_low=0.2,
        clip_high=0.3,
    )
    cfg = CorrectionConfig(method="tis")
    ent = torch.rand(lp_old.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))

    def f(x, h):
        return _loss(x, lp_old, lq, adv, mask, alg, cfg, entropy=h, ref=ref)[0]

    x = new_logprobs(lp_old, scale=0.4).requires_grad_()
    h = ent.clone().requires_grad_()
    loss = f(x, h)
    grads = torch.autograd.grad(loss, (x, h))
    _assert_matches(
        loss, grads, _reference(x, lp_old, lq, adv, mask, alg, cfg, entropy=ent, ref=ref), rel=1e-10
    )
    # finite differences where every ratio is inside the clip band (the surrogate is smooth there)
    smooth = (lp_old + 0.01).clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (smooth, ent.clone().requires_grad_()))


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_kl_penalty_reference(kind):
    """KL(pi || pi_ref) per token, written from its definition: k1 = log pi - log pi_ref,
    k3 = u - 1 - log u with u = pi_ref / pi (>= 0); d/d log pi: 1, and 1 - u (0 where |log u| > 20)."""
    lp_vals = [-1.0, -2.0, -0.3, -5.0, -0.01, -30.0]
    ref_vals = [-1.5, -1.0, -0.3, -0.2, -4.0, -1.0]
    lp = torch.tensor([lp_vals], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([ref_vals], dtype=torch.float64)
    kl = kl_penalty(lp, ref, kind)
    (grad,) = torch.autograd.grad(kl.sum(), lp)
    for j, (a, r) in enumerate(zip(lp_vals, ref_vals, strict=True)):
        if kind == "k1":
            want, dwant = a - r, 1.0
        else:
            log_u = max(-20.0, min(20.0, r - a))
            u = math.exp(log_u)
            want, dwant = u - 1.0 - log_u, (1.0 - u if abs(r - a) < 20 else 0.0)
            assert want >= 0
        assert kl[0, j].item() == pytest.approx(want, rel=1e-12, abs=1e-15), j
        assert grad[0, j].item() == pytest.approx(dwant, rel=1e-12, abs=1e-15), j


def test_value_loss_reference_and_gradcheck():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    old = v.detach() + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    ret = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) > 0.3
    loss, met = value_loss(v, old, ret, mask, clip=0.2, num_tokens=int(mask.sum()))
    want, grad, clipped = 0.0, torch.zeros(3, 5, dtype=torch.float64), 0
    n = int(mask.sum())
    for i in range(3):
        for t in range(5):
            if mask[i, t]:
                vv, vo, r = float(v.detach()[i, t]), float(old[i, t]), float(ret[i, t])
                vc = vo + max(-0.2, min(0.2, vv - vo))
                a, b = (vv - r) ** 2, (vc - r) ** 2
                want += 0.5 * max(a, b) / n
                clipped += b > a
                # d/dV: the unclipped branch, or the clipped one (whose V-dependence is 0 once clipped)
                grad[i, t] = ((vv - r) if a >= b else ((vc - r) if abs(vv - vo) < 0.2 else 0.0)) / n
    assert loss.item() == pytest.approx(want, rel=1e-12)
    (g_got,) = torch.autograd.grad(loss, v)
    torch.testing.assert_close(g_got, grad, rtol=1e-10, atol=1e-14)
    assert met["critic/value_clipfrac"].item() == pytest.approx(clipped / n)
    assert torch.autograd.gradcheck(
        lambda x: value_loss(x, old, ret, mask, clip=0.2, num_tokens=int(mask.sum()))[0], (v,)
    )


@settings(max_examples=30, deadline=None)
@given(batches(), st.sampled_from(AGGS), st.sampled_from(KERNELS))
def test_acrl_gamma_zero_equals_plain_loss(batch, agg, fused):
    """gamma = 0 is the uncorrected loss exactly (both kernels), and both are the reference's."""
    lp_old, lq, mask, adv = batch
    alg = AlgorithmConfig(loss_agg=agg, loss_norm_len=8, clip_low=0.2, clip_high=0.28)  # DAPO's clip-higher
    x = new_logprobs(lp_old).requires_grad_()
    out = []
    for cfg in (CorrectionConfig(method="none"), CorrectionConfig(method="acrl", gamma=0.0)):
        loss, _ = _loss(x, lp_old, lq, adv, mask, alg, cfg, fused=fused, acrl=AcrlSignal(0.1, 0.5))
        (grad,) = torch.autograd.grad(loss, x)
        out.append((loss.detach(), grad))
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1])
    want = _reference(x, lp_old, lq, adv, mask, alg, CorrectionConfig(method="none"))
    _assert_matches(out[0][0], (out[0][1],), want, rel=2e-5)


@settings(max_examples=30, deadline=None)
@given(
    batches(),
    st.sampled_from(AGGS),
    st.sampled_from(["none", "tis", "acrl", "geo_mis", "tis+norm", "acrl+norm"]),
    st.data(),
)
def test_micro_batches_with_global_denominators_match_whole_batch(batch, agg, method, data):
    """Two micro-batches with the step's global denominators (and, for batch_normalize, its global
    mean weight) give the whole batch's loss, gradient and metrics, which are the reference's."""
    lp_old, lq, mask, adv = (t.double() if t.is_floating_point() else t for t in batch)
    n_tok, n_seq = valid_counts(lp_old, lq, mask)
    alg = AlgorithmConfig(loss_agg=agg, loss_norm_len=8, kl_coef=0.1, clip_low=0.2, clip_high=0.28)
    name, _, norm = method.partition("+")
    cfg = CorrectionConfig(method=name, geo_low=0.5, geo_high=2.0, batch_normalize=bool(norm))
    ref = lp_old - 0.05
    x = new_logprobs(lp_old).requires_grad_()
    ent = torch.rand(lp_old.shape, dtype=torch.float64)
    sig = AcrlSignal(0.1, 0.2)
    mean = None
    if cfg.batch_normalize:  # once, over the whole batch, before the micro-batches
        mean = batch_weight_mean(
            cfg, MismatchTensors(lp_old, lq, mask, fused=False), advantages=adv, acrl=sig
        )

    def run(sl):
        return rl_loss(
            x[sl], lp_old[sl], lq[sl], adv[sl], mask[sl], algorithm=alg, correction=cfg, acrl=sig,
            num_tokens=n_tok, num_seqs=n_seq, fused=False, entropy=ent[sl], ref_logprobs=ref[sl],
            weight_mean=mean,
        )  # fmt: skip

    b = lp_old.shape[0]
    whole, m_whole = run(slice(0, b))
    (g_whole,) = torch.autograd.grad(whole, x)
    cut = data.draw(st.integers(0, b))
    (l1, m1), (l2, m2) = run(slice(0, cut)), run(slice(cut, b))
    (g_parts,) = torch.autograd.grad(l1 + l2, x)
    assert (l1 + l2).item() == pytest.approx(whole.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(g_parts, g_whole)
    want = _reference(x, lp_old, lq, adv, mask, alg, cfg, acrl=sig, entropy=ent, ref=ref)
    _assert_matches(whole, (g_whole,), want, rel=1e-9)
    fw, fp = finalize_metrics(m_whole), finalize_metrics(combine_partials([m1, m2]))
    assert fw.keys() == fp.keys()
    for k in fw:
        assert fp[k] == pytest.approx(fw[k], rel=1e-9, abs=1e-12, nan_ok=True), k
    if cfg.batch_normalize:
        assert fw["correction/weight_mean"] == pytest.approx(1.0 if n_tok else 0.0, rel=1e-12, abs=1e-12)


def test_batch_normalize_by_the_micro_batch_moved_the_loss():
    """The defect: each micro-batch normalised by its own mean moved the loss by up to 40% between
    two cuts of the same batch. With the batch's mean passed down, every cut gives the reference."""
    g = torch.Generator().manual_seed(8)
    lp_old = -torch.rand(8, 12, generator=g, dtype=torch.float64) * 2
    lq = lp_old.clone()
    lq[:4] += 0.8  # half the batch far off-policy: its TIS weights are small
    mask = torch.ones(8, 12, dtype=torch.bool)
    adv = torch.randn(8, 1, generator=g, dtype=torch.float64).expand(8, 12)
    alg = AlgorithmConfig(loss_agg="token-mean")
    cfg = CorrectionConfig(method="tis", batch_normalize=True)
    x = new_logprobs(lp_old)
    sh = MismatchTensors(lp_old, lq, mask, fused=False)
    mean = batch_weight_mean(cfg, sh)
    want = _reference(x, lp_old, lq, adv, mask, alg, cfg)[0]
    for cut in (2, 4, 6):
        parts = [
            rl_loss(x[sl], lp_old[sl], lq[sl], adv[sl], mask[sl], algorithm=alg, correction=cfg, acrl=None,
                    num_tokens=96, num_seqs=8, fused=False, weight_mean=mean)[0]
            for sl in (slice(0, cut), slice(cut, 8))
        ]  # fmt: skip
        assert sum(parts).item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("fused", KERNELS)
def test_nonfinite_old_logprob_never_reaches_the_gradient(fused):
    """A NaN / Inf log pi_old on a valid token: dropped from the loss like padding (zero gradient),
    the rest of the loss is the reference's without that token."""
    lp_old, lq, mask, adv = make_batch(seed=6, scale=0.2)
    lp_old[1, 0], lp_old[2, 0] = float("nan"), -float("inf")
    assert mask[1, 0] and mask[2, 0]
    alg = AlgorithmConfig(loss_agg="seq-mean-token-mean", kl_coef=0.1)
    cfg = CorrectionConfig(method="acrl")
    x = new_logprobs(torch.nan_to_num(lp_old, nan=-1.0, neginf=-1.0)).requires_grad_()
    ref = x.detach() - 0.1
    loss, metrics = _loss(x, lp_old, lq, adv, mask, alg, cfg, fused=fused, ref=ref)
    (g,) = torch.autograd.grad(loss, x)
    assert torch.isfinite(g).all() and g[1, 0] == 0 and g[2, 0] == 0
    assert finalize_metrics(metrics)["mismatch/nonfinite_tokens"] == 2
    _assert_matches(loss, (g,), _reference(x, lp_old, lq, adv, mask, alg, cfg, ref=ref), rel=1e-5)


def test_aggregate_modes_by_hand():
    x = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(x, m, "token-mean", num_tokens=3, num_seqs=2).item() == pytest.approx(7 / 3)
    assert aggregate(x, m, "seq-mean-token-mean", num_tokens=3, num_seqs=2).item() == pytest.approx(
        (1.5 + 4) / 2
    )
    assert aggregate(x, m, "seq-mean-token-sum-norm", num_tokens=3, num_seqs=2, norm_len=4).item() == (
        pytest.approx(7 / 8)
    )
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(x, m, "seq-mean-token-sum-norm", num_tokens=3, num_seqs=2)
    # the smallest constant length is 1 (a sum per sequence); 0 is refused with the key to set
    assert aggregate(x, m, "seq-mean-token-sum-norm", num_tokens=3, num_seqs=2, norm_len=1).item() == 3.5
    with pytest.raises(ValueError, match=r"needs norm_len >= 1 \(algorithm.loss_norm_len\)"):
        aggregate(x, m, "seq-mean-token-sum-norm", num_tokens=3, num_seqs=2, norm_len=0)
    with pytest.raises(ValueError, match="unknown loss aggregation 'seq-sum'"):
        aggregate(x, m, "seq-sum", num_tokens=3, num_seqs=2)
    # a row of masked-in values: the per-sequence means divide by each row's own length (over T)
    y = torch.tensor([[2.0, 4.0, 6.0], [3.0, 3.0, 3.0]])
    full = torch.ones(2, 3, dtype=torch.bool)
    assert aggregate(y, full, "seq-mean-token-mean", num_tokens=6, num_seqs=2).item() == pytest.approx(3.5)


def test_ppo_clip_behaviour():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, clipped = ppo_policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # A>0, r=1.5 -> clipped at 1.28; A>0, r=0.5 -> unclipped (min objective); A<0, r=1.5 -> unclipped;
    # A<0, r=0.5 -> clipped at 0.8.
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -0.5, 1.5, 0.8]]))
    assert clipped.tolist() == [[True, False, False, True]]
    dual, _ = ppo_policy_loss(
        torch.log(torch.tensor([[5.0]])),
        torch.zeros(1, 1),
        torch.tensor([[-1.0]]),
        torch.ones(1, 1),
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=3.0,
    )
    assert dual.item() == pytest.approx(3.0)


def test_kl_needs_reference():
    lp, lq, mask, adv = make_batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        rl_loss(
            lp,
            lp,
            lq,
            adv,
            mask,
            algorithm=AlgorithmConfig(kl_coef=0.1),
            correction=CorrectionConfig(method="none"),
            acrl=None,
            num_tokens=10,
            num_seqs=2,
            fused=False,
        )


def test_reference_weights_are_not_the_package_weights_by_construction():
    """A sanity check of the reference itself on numbers worked out by hand (rho = e^0.5, e^-1)."""
    lp = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    lq = torch.tensor([[-0.5, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    tis = ref_weights(dataclasses.replace(CorrectionConfig(), method="tis", tis_high=1.5), lp, lq, mask)
    assert tis == [[1.5, pytest.approx(math.exp(-1.0))]]
    acrl = ref_weights(
        CorrectionConfig(method="acrl", gamma=1.0), lp, lq, mask, torch.ones(1, 2), x=0.1, y=0.2
    )
    assert acrl == [[pytest.approx(math.exp(-0.5)), pytest.approx(math.exp(1.0))]]  # alpha = -1


def test_value_loss_clips_both_sides_and_counts_one_token():
    """V moved past V_old -+ clip on either side: the clipped branch is the one the loss takes; one
    valid token is its own denominator (its clip fraction is 1, not 1/2)."""
    old = torch.zeros(1, 4, dtype=torch.float64)
    v = torch.tensor([[-1.0, 1.0, 0.1, -1.0]], dtype=torch.float64, requires_grad=True)
    ret = torch.tensor([[-2.0, 2.0, 0.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    loss, met = value_loss(v, old, ret, mask, clip=0.2, num_tokens=3)
    # clipped values -0.2, 0.2, 0.1: (V_c - R)^2 = 3.24, 3.24, 0.01 beat (V - R)^2 = 1, 1, 0.01 on two
    assert loss.item() == pytest.approx(0.5 * (3.24 + 3.24 + 0.01) / 3, rel=1e-12)
    assert set(met) == {"critic/value_loss", "critic/value_clipfrac"}
    assert met["critic/value_loss"].item() == loss.item() and not met["critic/value_loss"].requires_grad
    assert met["critic/value_clipfrac"].item() == pytest.approx(2 / 3)
    assert met["critic/value_clipfrac"].dtype == torch.float64  # the values' dtype, not int / int
    one = torch.tensor([[True, False, False, False]])
    _, met = value_loss(v, old, ret, one, clip=0.2, num_tokens=1)
    assert met["critic/value_clipfrac"].item() == 1.0


def test_sft_loss_is_the_token_mean_nll_over_the_global_count():
    from megatron_acrl.algo.losses import sft_loss

    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, met = sft_loss(lp, {"loss_mask": mask}, 5, 2)  # 5: other micro-batches'
    assert loss.item() == pytest.approx((1.0 + 2.0 + 0.5) / 5, rel=1e-12)
    assert set(met) == {"sft/nll"} and met["sft/nll"].item() == loss.item()
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, -mask.double() / 5)


def test_k3_saturates_the_log_ratio_at_20_and_names_unknown_estimators():
    """k3 = r - 1 - log r with log r cut to [-20, 20] (as rho everywhere): from the definition."""
    ref = torch.zeros(1, 4, dtype=torch.float64)
    logp = torch.tensor([[25.0, 20.5, -0.5, -25.0]], dtype=torch.float64)  # log r = ref - logp
    got = kl_penalty(logp, ref, "k3")[0].tolist()
    want = [math.exp(c) - 1.0 - c for c in (-20.0, -20.0, 0.5, 20.0)]
    assert got == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match=r"^unknown KL estimator 'k2'; use k1 or k3"):
        kl_penalty(logp, ref, "k2")


def test_pg_metrics_and_a_binding_dual_clip_by_hand():
    """Four tokens worked by hand (clip 0.2 / 0.28, dual clip 3): r = 1 (A = 1) unclipped, r = 1.5
    (A = 1) clipped to 1.28, r = 0.5 (A = -1) clipped to 0.8, r = 5 (A = -1) bounded by the dual
    clip at 3. pg_clipfrac counts the two clipped tokens; ppo_kl is the mean of log pi_old - log pi."""
    ratios = [1.0, 1.5, 0.5, 5.0]
    lp_old = torch.full((1, 4), -1.0, dtype=torch.float64)
    x = (lp_old + torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    cfg = CorrectionConfig(method="none")
    for dual, terms in ((3.0, [-1.0, -1.28, 0.8, 3.0]), (None, [-1.0, -1.28, 0.8, 5.0])):
        alg = AlgorithmConfig(loss_agg="token-mean", clip_low=0.2, clip_high=0.28, dual_clip=dual)
        loss, metrics = _loss(x, lp_old, lp_old.clone(), adv, mask, alg, cfg)
        assert loss.item() == pytest.approx(sum(terms) / 4, rel=1e-12), dual
        assert float(metrics["loss/pg_clipfrac"]) == pytest.approx(2 / 4), dual
        assert float(metrics["loss/ppo_kl"]) == pytest.approx(
            -sum(math.log(r) for r in ratios) / 4, rel=1e-12
        )
        assert float(metrics["loss/pg_loss"]) == pytest.approx(sum(terms) / 4, rel=1e-12)


def test_regularizer_metrics_and_the_norm_len_argument_by_hand():
    """KL (k1) and entropy terms on three valid tokens and one padded one, worked by hand: their
    token means, the total, the message when the reference log-probs are missing, and a norm_len
    passed to rl_loss overriding algorithm.loss_norm_len."""
    lp_old = torch.full((1, 4), -1.0, dtype=torch.float64)
    x = lp_old.clone().requires_grad_()  # r = 1 everywhere: the surrogate is -A per token
    adv = torch.tensor([[1.0, -2.0, 0.5, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    ref = torch.tensor([[-1.5, -0.5, -1.0, 7.0]], dtype=torch.float64)  # k1 = x - ref: 0.5, -0.5, 0
    ent = torch.tensor([[0.3, 0.6, 0.9, 50.0]], dtype=torch.float64)
    cfg = CorrectionConfig(method="none")
    alg = AlgorithmConfig(loss_agg="token-mean", kl_coef=0.1, kl_type="k1", entropy_coef=0.01)
    loss, m = _loss(x, lp_old, lp_old.clone(), adv, mask, alg, cfg, entropy=ent, ref=ref)
    pg, kl, h = (-1.0 + 2.0 - 0.5) / 3, (0.5 - 0.5 + 0.0) / 3, (0.3 + 0.6 + 0.9) / 3
    assert float(m["loss/kl_ref"]) == pytest.approx(kl, abs=1e-15)
    assert float(m["loss/entropy"]) == pytest.approx(h, rel=1e-12)
    assert float(m["loss/total"]) == pytest.approx(pg + 0.1 * kl - 0.01 * h, rel=1e-12)
    assert loss.item() == pytest.approx(pg + 0.1 * kl - 0.01 * h, rel=1e-12)
    with pytest.raises(ValueError, match=r"^algorithm\.kl_coef > 0 needs ref_logprobs"):
        _loss(x, lp_old, lp_old.clone(), adv, mask, alg, cfg, entropy=ent)
    norm = AlgorithmConfig(loss_agg="seq-mean-token-sum-norm", loss_norm_len=2)
    loss, _ = _loss(x, lp_old, lp_old.clone(), adv, mask, norm, cfg, norm_len=8)
    assert loss.item() == pytest.approx((-1.0 + 2.0 - 0.5) / 8, rel=1e-12)  # one sequence, / norm_len 8


def test_a_single_token_batch_divides_by_one() -> None:
    """Global counts of 1 (one valid token, one sequence): the loss, the clip fraction and the PPO KL
    are that token's own values, never halved (a count is floored at 1, not 2)."""
    alg = AlgorithmConfig(clip_low=0.2, clip_high=0.28)
    lp = torch.tensor([[0.5, 0.0]], requires_grad=True)  # ratio e^0.5 > 1.28: clipped (A > 0)
    old = torch.zeros(1, 2)
    mask = torch.tensor([[True, False]])
    loss, metrics = rl_loss(
        lp, old, old, torch.ones(1, 2), mask, algorithm=alg, correction=CorrectionConfig(method="none"),
        acrl=None, num_tokens=torch.tensor(1), num_seqs=torch.tensor(1), fused=False,
    )  # fmt: skip
    out = finalize_metrics(metrics)
    assert loss.item() == pytest.approx(-1.28, rel=1e-6)  # -A * clip(ratio) of the one token
    assert out["loss/pg_clipfrac"] == 1.0
    assert out["loss/ppo_kl"] == pytest.approx(-0.5, rel=1e-6)  # mean of log pi_old - log pi


@pytest.mark.parametrize("fused", KERNELS, ids=lambda f: "fused_cpu" if f else "torch")
@pytest.mark.parametrize(
    "method,batch_norm", [("none", False), ("tis", True), ("icepop", False), ("acrl", True)]
)
@pytest.mark.parametrize("agg", AGGS)
def test_the_bound_loss_is_rl_loss_bit_for_bit(agg, method, batch_norm, fused):
    """RLLoss(settings)(logprobs, micro_batch, num_tokens, num_seqs) is today's rl_loss call, bit for
    bit: loss, every metric, and the gradients of log pi and of the entropies, on a float32 batch with
    every optional input (reference log-probs, entropies, a norm_len, the step's weight mean, the
    ACRL signal, a non-finite log mu). The float64 comparisons above cover rl_loss itself."""
    lp_old, lq, mask, adv = make_batch(seed=3, b=7, t=11)
    lq[1, 2] = float("nan")  # leaves the loss mask: the object must pass the same mask through
    mask = mask.float()
    ref = new_logprobs(lp_old, seed=5)
    g = torch.Generator().manual_seed(7)
    ent0 = torch.rand(lp_old.shape, generator=g)
    alg = AlgorithmConfig(
        loss_agg=agg, kl_coef=0.1, kl_type="k3", entropy_coef=0.01, loss_norm_len=5, dual_clip=3.0
    )
    cfg = CorrectionConfig(method=method, batch_normalize=batch_norm)
    n_tok, n_seq = torch.tensor(float(valid_counts(lp_old, lq, mask)[0])), torch.tensor(6.0)
    wm = batch_weight_mean(cfg, MismatchTensors(lp_old, lq, mask, fused=fused), advantages=adv, acrl=SIG)
    wm = wm if batch_norm else None
    micro = {"tokens": torch.zeros(7, 11, dtype=torch.long), "old_logprobs": lp_old,
             "rollout_logprobs": lq, "advantages": adv, "loss_mask": mask, "ref_logprobs": ref}  # fmt: skip
    runs = []
    for bound in (True, False):
        x, ent = new_logprobs(lp_old).requires_grad_(), ent0.clone().requires_grad_()
        if bound:
            loss, metrics = RLLoss(alg, cfg, fused=fused, norm_len=9)(
                x, micro, n_tok, n_seq, entropy=ent, acrl=SIG, weight_mean=wm
            )
        else:
            loss, metrics = rl_loss(
                x, lp_old, lq, adv, mask, algorithm=alg, correction=cfg, acrl=SIG, num_tokens=n_tok,
                num_seqs=n_seq, fused=fused, entropy=ent, ref_logprobs=ref, norm_len=9, weight_mean=wm,
            )  # fmt: skip
        runs.append((loss, metrics, torch.autograd.grad(loss, (x, ent))))
    (loss, metrics, grads), (want, want_metrics, want_grads) = runs
    assert torch.equal(loss, want) and loss.item() != 0
    assert metrics.keys() == want_metrics.keys() and {"loss/kl_ref", "loss/entropy"} <= metrics.keys()
    for k, v in metrics.items():
        assert torch.equal(v, want_metrics[k]) or (v.isnan() & want_metrics[k].isnan()).all(), k
    for got, ref_grad in zip(grads, want_grads, strict=True):
        assert torch.equal(got, ref_grad)


def test_the_bound_loss_keeps_its_settings_and_can_drop_the_mismatch_metrics():
    """Without ref_logprobs in the micro-batch a kl_coef > 0 loss names what is missing (as rl_loss);
    with_mismatch_metrics=False leaves out mismatch/*; the default norm_len is the algorithm's."""
    lp_old, lq, mask, adv = make_batch(seed=4)
    micro = {"old_logprobs": lp_old, "rollout_logprobs": lq, "advantages": adv, "loss_mask": mask}
    n_tok, n_seq = valid_counts(lp_old, lq, mask)
    plain = CorrectionConfig(method="none")
    with pytest.raises(ValueError, match=r"^algorithm\.kl_coef > 0 needs ref_logprobs"):
        RLLoss(AlgorithmConfig(kl_coef=0.1), plain, fused=False)(lp_old, micro, n_tok, n_seq)
    norm = AlgorithmConfig(loss_agg="seq-mean-token-sum-norm", loss_norm_len=3)
    full = RLLoss(norm, plain, fused=False)(lp_old, micro, n_tok, n_seq)
    lean = RLLoss(norm, plain, fused=False, with_mismatch_metrics=False)(lp_old, micro, n_tok, n_seq)
    want = rl_loss(lp_old, lp_old, lq, adv, mask, algorithm=norm, correction=plain, acrl=None,
                   num_tokens=n_tok, num_seqs=n_seq, fused=False)  # fmt: skip
    assert torch.equal(full[0], want[0]) and torch.equal(lean[0], want[0])
    assert any(k.startswith("mismatch/") for k in full[1])
    assert not any(k.startswith("mismatch/") for k in lean[1])
    assert set(lean[1]) == {k for k in full[1] if not k.startswith("mismatch/")}
