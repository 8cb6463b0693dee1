"""Fused vocab-parallel log-prob/entropy vs a float64 full softmax: values and gradients."""

from __future__ import annotations

import pytest
import torch
from dist_launch import launch

from megatron_acrl.megatron.logprobs import vocab_parallel_logprobs


def _reference(logits: torch.Tensor, target: torch.Tensor, vocab: int, temperature: float):
    x = logits.double()[..., :vocab].clone().requires_grad_(True)
    logp = torch.log_softmax(x / temperature, -1)
    lp = logp.gather(-1, target[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return x, lp, ent


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 4, 100])
@pytest.mark.parametrize("vocab,padded", [(37, 37), (37, 48)])
def test_single_rank_matches_float64(temperature, chunk, vocab, padded):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 7, padded, generator=g) * 3
    target = torch.randint(0, vocab, (2, 7), generator=g)
    g_lp, g_ent = torch.randn(2, 7, generator=g), torch.randn(2, 7, generator=g)
    before = logits.clone()
    leaf = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(
        leaf,
        target,
        tp_group=None,
        vocab_size=vocab,
        temperature=temperature,
        chunk_size=chunk,
        with_entropy=True,
    )
    (lp * g_lp + ent * g_ent).sum().backward()
    x, ref_lp, ref_ent = _reference(logits, target, vocab, temperature)
    (ref_lp * g_lp + ref_ent * g_ent).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(leaf.grad[..., :vocab].double(), x.grad, atol=2e-6, rtol=1e-5)
    assert torch.count_nonzero(leaf.grad[..., vocab:]) == 0, "padding columns get no gradient"
    assert torch.equal(leaf.detach(), before), "the caller's logits must not be modified"


def test_logprob_only_gradient_and_no_entropy():
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(5, 11, generator=g) * 2).requires_grad_(True)
    target = torch.randint(0, 11, (5,), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, target, tp_group=None, chunk_size=2)
    assert ent is None
    lp.sum().backward()
    x, ref_lp, _ = _reference(logits.detach(), target, 11, 1.0)
    ref_lp.sum().backward()
    torch.testing.assert_close(logits.grad.double(), x.grad, atol=1e-6, rtol=1e-6)


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0, 3.0], [-1e30, -1e30, -1e30, 0.0]], requires_grad=True)
    target = torch.tensor([1, 3])
    lp, ent = vocab_parallel_logprobs(logits, target, tp_group=None, with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(logits.grad).all()
    assert lp[0].item() == pytest.approx(-2e4, rel=1e-6)


def test_tensor_parallel_over_gloo_ranks_matches_float64():
    """TP=2 (two gloo processes): MAX/SUM all-reduces, target from the owning shard, vocab padding on
    the last shard, temperature, chunking; float32 and bfloat16 logits."""
    res = launch("logprobs", 2, timeout=300)
    assert res[0].keys() == res[1].keys()
    for rank_res in res:
        for key, r in rank_res.items():
            bf16 = key.startswith("bfloat16")
            assert r["lp_err"] < 5e-6 and r["ent_err"] < 5e-6, (key, r)
            # bf16: the gradient is returned in the logits' dtype (8 mantissa bits)
            assert r["grad_err"] < (2**-7 if bf16 else 2e-6) * max(r["grad_scale"], 1.0), (key, r)
            assert r["pad_grad"] == 0.0, key


def test_inplace_backward_gives_the_same_gradient_in_the_logits_storage():
    g = torch.Generator().manual_seed(9)
    base = torch.randn(6, 20, generator=g).to(torch.bfloat16)
    target = torch.randint(0, 17, (6,), generator=g)
    grads = []
    for inplace in (False, True):
        leaf = base.clone().requires_grad_(True)
        x = leaf * 1  # a non-leaf "model output", as in the trainer
        lp, ent = vocab_parallel_logprobs(
            x,
            target,
            tp_group=None,
            vocab_size=17,
            temperature=0.9,
            chunk_size=4,
            with_entropy=True,
            inplace_backward=inplace,
        )
        (lp.sum() + 0.3 * ent.sum()).backward()
        grads.append(leaf.grad)
        if inplace:
            assert torch.equal(x.detach(), leaf.grad), "the gradient lives in the logits' storage"
    assert torch.equal(grads[0], grads[1])
