"""Policy/value/KL losses against float64 references: values, gradients, invariances."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ref_policy_loss, ref_weights
from test_correction import KERNELS, batches, counts, make_batch

from megatron_acrl.config import AlgorithmConfig, CorrectionConfig
from megatron_acrl.correction import AcrlSignal, combine_partials, finalize_metrics
from megatron_acrl.losses import aggregate, kl_penalty, ppo_policy_loss, rl_loss, value_loss

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def new_logprobs(lp, seed=1, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    return (lp + scale * torch.randn(lp.shape, generator=g, dtype=lp.dtype)).clone()


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("method", ["none", "tis", "seq_mis", "icepop", "acrl"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_rl_loss_matches_reference_value_and_grad(agg, method, dual_clip):
    lp_old, lq, mask, adv = make_batch(seed=2, scale=0.2, dtype=torch.float64)
    n_tok, n_seq = counts(mask)
    alg = AlgorithmConfig(loss_agg=agg, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, loss_norm_len=9)
    cfg = CorrectionConfig(method=method)
    sig = AcrlSignal(x=0.05, y=0.09)
    x = new_logprobs(lp_old).requires_grad_()
    loss, _ = rl_loss(
        x, lp_old, lq, adv, mask, algorithm=alg, correction=cfg, acrl=sig, num_tokens=n_tok, num_seqs=n_seq,
        fused=False,
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, x)
    w = ref_weights(cfg, lp_old, lq, mask, adv, x=0.05, y=0.09)
    xr = x.detach().clone().requires_grad_()
    want = ref_policy_loss(
        xr, lp_old, adv, mask, w, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, agg=agg, norm_len=9
    )
    (gr,) = torch.autograd.grad(want, xr)
    assert loss.item() == pytest.approx(want.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(g, gr, rtol=1e-9, atol=1e-12)
    assert (g[~mask] == 0).all()


@pytest.mark.parametrize("agg", AGGS)
def test_gradcheck_policy_kl_entropy(agg):
    lp_old, lq, mask, adv = make_batch(seed=4, b=3, t=4, dtype=torch.float64)
    n_tok, n_seq = counts(mask)
    ref = lp_old - 0.1
    alg = AlgorithmConfig(
        loss_agg=agg, kl_coef=0.3, entropy_coef=0.01, loss_norm_len=4, clip_low=0.2, clip_high=0.3
    )

    def f(x, ent):
        loss, _ = rl_loss(
            x,
            lp_old,
            lq,
            adv,
            mask,
            algorithm=alg,
            correction=CorrectionConfig(method="tis"),
            acrl=None,
            num_tokens=n_tok,
            num_seqs=n_seq,
            fused=False,
            entropy=ent,
            ref_logprobs=ref,
        )
        return loss

    # Keep ratios inside the clip band so the surrogate is smooth where gradcheck probes it.
    x = (lp_old + 0.01).clone().requires_grad_()
    ent = torch.rand(lp_old.shape, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(f, (x, ent))


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_kl_penalty_reference(kind):
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    kl = kl_penalty(lp, ref, kind)
    if kind == "k1":
        want = lp.detach() - ref
    else:
        r = torch.exp(ref - lp.detach())
        want = r - 1 - torch.log(r)
    torch.testing.assert_close(kl.detach(), want)
    assert torch.autograd.gradcheck(lambda x: kl_penalty(x, ref, kind), (lp,))


def test_value_loss_reference_and_gradcheck():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    old = v.detach() + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    ret = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) > 0.3
    loss, met = value_loss(v, old, ret, mask, clip=0.2, num_tokens=int(mask.sum()))
    want = 0.0
    for i in range(3):
        for t in range(5):
            if mask[i, t]:
                vc = float(old[i, t]) + max(-0.2, min(0.2, float(v.detach()[i, t]) - float(old[i, t])))
                want += 0.5 * max(
                    (float(v.detach()[i, t]) - float(ret[i, t])) ** 2, (vc - float(ret[i, t])) ** 2
                )
    assert loss.item() == pytest.approx(want / int(mask.sum()))
    assert torch.autograd.gradcheck(
        lambda x: value_loss(x, old, ret, mask, clip=0.2, num_tokens=int(mask.sum()))[0], (v,)
    )
    assert 0 <= met["critic/value_clipfrac"].item() <= 1


@settings(max_examples=30, deadline=None)
@given(batches(), st.sampled_from(AGGS), st.sampled_from(KERNELS))
def test_acrl_gamma_zero_equals_plain_loss(batch, agg, fused):
    lp_old, lq, mask, adv = batch
    n_tok, n_seq = counts(mask)
    alg = AlgorithmConfig(loss_agg=agg, loss_norm_len=8)
    x = new_logprobs(lp_old).requires_grad_()
    out = []
    for cfg in (CorrectionConfig(method="none"), CorrectionConfig(method="acrl", gamma=0.0)):
        loss, _ = rl_loss(
            x,
            lp_old,
            lq,
            adv,
            mask,
            algorithm=alg,
            correction=cfg,
            acrl=AcrlSignal(0.1, 0.5),
            num_tokens=n_tok,
            num_seqs=n_seq,
            fused=fused,
        )
        (grad,) = torch.autograd.grad(loss, x)
        out.append((loss.detach(), grad))
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1])


@settings(max_examples=30, deadline=None)
@given(batches(), st.sampled_from(AGGS), st.sampled_from(["none", "tis", "acrl", "geo_mis"]), st.data())
def test_micro_batches_with_global_denominators_match_whole_batch(batch, agg, method, data):
    lp_old, lq, mask, adv = (t.double() if t.is_floating_point() else t for t in batch)
    n_tok, n_seq = counts(mask)
    alg = AlgorithmConfig(loss_agg=agg, loss_norm_len=8, kl_coef=0.1)
    cfg = CorrectionConfig(method=method, geo_low=0.5, geo_high=2.0)
    ref = lp_old - 0.05
    x = new_logprobs(lp_old).requires_grad_()
    ent = torch.rand(lp_old.shape, dtype=torch.float64)

    def run(sl):
        return rl_loss(
            x[sl],
            lp_old[sl],
            lq[sl],
            adv[sl],
            mask[sl],
            algorithm=alg,
            correction=cfg,
            acrl=AcrlSignal(0.1, 0.2),
            num_tokens=n_tok,
            num_seqs=n_seq,
            fused=False,
            entropy=ent[sl],
            ref_logprobs=ref[sl],
        )

    b = lp_old.shape[0]
    whole, m_whole = run(slice(0, b))
    (g_whole,) = torch.autograd.grad(whole, x)
    cut = data.draw(st.integers(0, b))
    (l1, m1), (l2, m2) = run(slice(0, cut)), run(slice(cut, b))
    (g_parts,) = torch.autograd.grad(l1 + l2, x)
    assert (l1 + l2).item() == pytest.approx(whole.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(g_parts, g_whole)
    fw, fp = finalize_metrics(m_whole), finalize_metrics(combine_partials([m1, m2]))
    for k in fw:
        # std = sqrt(E[w^2] - E[w]^2) turns 1e-16 rounding of the sums into 1e-8.
        tol = 1e-6 if k.endswith("weight_std") else 1e-12
        assert fp[k] == pytest.approx(fw[k], rel=1e-9, abs=tol, nan_ok=True), k


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
