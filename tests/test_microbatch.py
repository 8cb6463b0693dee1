"""Micro-batch plans (``megatron_acrl.batch.microbatch``): token-budget packing, DP balance, and the loss
they feed, which must not change with the cut (float64, values and gradients)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ref_rl_loss, ref_weights
from test_correction import counts

from megatron_acrl.algo.losses import rl_loss
from megatron_acrl.batch.microbatch import budget_plan, fixed_plan, row_lengths
from megatron_acrl.config import AlgorithmConfig, CorrectionConfig
from megatron_acrl.correction import AcrlSignal

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(1, 64), min_size=1, max_size=48),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([1, 2, 4]),
    st.integers(64, 300),
    st.sampled_from([1, 2]),
)
def test_budget_plan_packs_every_row_once_within_the_budget(lengths, dp, multiple, budget, count_multiple):
    n = len(lengths) - len(lengths) % (dp * count_multiple)
    if n < dp * count_multiple:
        return
    lengths = lengths[:n]
    plan = budget_plan(lengths, dp=dp, budget=budget, multiple=multiple, count_multiple=count_multiple)
    rows = sorted(i for r in plan.ranks for mb in r for i in mb.rows)
    assert rows == list(range(n))  # every row exactly once
    assert len({len(r) for r in plan.ranks}) == 1  # the same micro-batch count on every DP rank
    assert plan.num_microbatches % count_multiple == 0
    for r in plan.ranks:
        for mb in r:
            assert mb.rows and mb.padded_tokens <= budget
            # padded to its own longest row only (rounded to the TP multiple)
            assert mb.length == _round_up(max(lengths[i] for i in mb.rows), multiple)


def test_first_fit_decreasing_is_tight_and_balances_tokens_not_sequences():
    # A long-tailed batch: a few long sequences, many short ones.
    lengths = [256, 200, 180] + [16] * 29
    plan = budget_plan(lengths, dp=2, budget=512, multiple=1)
    fixed = fixed_plan(lengths, dp=2, micro_batch_size=4, width=256)
    assert plan.padding_fraction() < 0.25 < fixed.padding_fraction()
    tokens = plan.rank_tokens()
    assert max(tokens) / (sum(tokens) / 2) < 1.1  # balanced tokens ...
    seqs = [sum(len(mb.rows) for mb in r) for r in plan.ranks]
    assert seqs[0] != seqs[1]  # ... not balanced sequence counts
    m = plan.metrics()
    assert set(m) == {"perf/padding_fraction", "perf/microbatches", "perf/dp_token_imbalance"}
    assert m["perf/microbatches"] == plan.num_microbatches


def test_fixed_plan_is_the_contiguous_layout():
    plan = fixed_plan([3, 5, 2, 7, 1, 1, 4, 4], dp=2, micro_batch_size=2, width=8)
    assert [[mb.rows for mb in r] for r in plan.ranks] == [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]
    assert all(mb.length == 8 for r in plan.ranks for mb in r)
    assert plan.padding_fraction() == pytest.approx(1 - 27 / 64)
    with pytest.raises(ValueError, match="multiple of 6"):
        fixed_plan([1] * 8, dp=2, micro_batch_size=3, width=4)


def test_budget_errors_name_the_fix():
    with pytest.raises(ValueError, match="raise the budget"):
        budget_plan([10, 40], dp=1, budget=32)
    with pytest.raises(ValueError, match="padded 34"):
        budget_plan([33], dp=1, budget=33, multiple=2)
    with pytest.raises(ValueError, match="multiple of 2"):
        budget_plan([8, 8, 8], dp=2, budget=8)  # three single-row micro-batches cannot split over 2
    with pytest.raises(ValueError, match="cannot be shared"):
        budget_plan([8], dp=2, budget=64)


def test_row_lengths_end_at_the_last_loss_position():
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 0, 1]])
    assert row_lengths(mask, 3, 5) == [3, 1, 5]
    assert row_lengths(None, 2, 7) == [7, 7]


def _varlen_batch(seed: int, b: int = 10, t: int = 24):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    lq = lp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):  # prompt of 2..4, long-tailed response ends
        end = int(4 + (t - 4) * torch.rand(1, generator=g).item() ** 3) + 1
        mask[i, 2 + i % 3 : min(end, t)] = True
    mask[-1] = False  # a sequence with no response token
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone()
    return lp, lq, mask, adv


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("method", ["none", "tis", "acrl"])
@pytest.mark.parametrize("dp,budget,multiple", [(1, 30, 1), (2, 48, 2), (2, 24, 1)])
def test_loss_and_gradient_do_not_change_with_the_cut(agg, method, dp, budget, multiple):
    """Summed over the micro-batches of every DP rank (rows cut to their own padded length), the
    loss and its gradient equal an independent float64 reference on the whole batch."""
    lp_old, lq, mask, adv = _varlen_batch(seed=3)
    n_tok, n_seq = counts(mask)
    alg = AlgorithmConfig(loss_agg=agg, loss_norm_len=20, clip_low=0.2, clip_high=0.28)
    cfg = CorrectionConfig(method=method)
    g = torch.Generator().manual_seed(5)
    x = (lp_old + 0.3 * torch.randn(lp_old.shape, generator=g, dtype=torch.float64)).requires_grad_()
    b, t = mask.shape
    plan = budget_plan(row_lengths(mask, b, t), dp=dp, budget=budget, multiple=multiple)
    assert plan.num_microbatches > 1
    total = x.new_zeros(())
    for mb in (m for r in plan.ranks for m in r):
        rows = torch.tensor(mb.rows)

        def cut(v: torch.Tensor, rows: torch.Tensor = rows, n: int = mb.length) -> torch.Tensor:
            v = v[rows][:, :n]
            return torch.nn.functional.pad(v, (0, n - v.shape[1])) if v.shape[1] < n else v

        part, _ = rl_loss(
            cut(x), cut(lp_old), cut(lq), cut(adv), cut(mask), algorithm=alg, correction=cfg,
            acrl=AcrlSignal(x=0.05, y=0.09), num_tokens=n_tok, num_seqs=n_seq, fused=False,
        )  # fmt: skip
        total = total + part
    (grad,) = torch.autograd.grad(total, x)
    w = ref_weights(cfg, lp_old, lq, mask, adv, x=0.05, y=0.09)
    want, want_grad, _ = ref_rl_loss(
        x.detach(), lp_old, lq, adv, mask, w, agg=agg, clip_low=0.2, clip_high=0.28, norm_len=20
    )
    assert total.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=grad.dtype), rtol=1e-9, atol=1e-12)
