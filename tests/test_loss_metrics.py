"""Issue #34: ``loss/ratio_max`` (the largest pi / pi_old on a trained token, a MAX over
micro-batches and ranks, never averaged) and ``loss/dual_clip_frac`` against float64 references,
split over micro-batches and over two gloo ranks."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_acrl.algo.losses import RLLoss
from megatron_acrl.config import AlgorithmConfig, CorrectionConfig
from megatron_acrl.correction import combine_partials, finalize_metrics
from megatron_acrl.megatron.collectives import all_reduce_partials

ALG = AlgorithmConfig(loss_agg="token-mean", clip_low=0.2, clip_high=0.28, dual_clip=3.0)


def batch(seed: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 9
    old = -torch.rand(b, t, generator=g) * 2 - 0.1
    logp = old + torch.randn(b, t, generator=g) * 0.8  # ratios well beyond the dual clip's 3
    mask = (torch.arange(t) < torch.tensor([9, 4, 0, 7, 2, 9])[:, None]).float()
    logp[1, 6] = old[1, 6] + 9.0  # padding: a huge ratio that must not count
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    return {"logprobs": logp, "old_logprobs": old, "rollout_logprobs": old + 0.01, "advantages": adv,
            "loss_mask": mask}  # fmt: skip


def ref_metrics(d: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max pi / pi_old over trained tokens, fraction of them the dual clip bounds), in float64 Python."""
    r_max, dual, n = -math.inf, 0, 0
    for i in range(d["loss_mask"].shape[0]):
        for t in range(d["loss_mask"].shape[1]):
            if d["loss_mask"][i, t] == 0:
                continue
            n += 1
            r = math.exp(float(d["logprobs"][i, t]) - float(d["old_logprobs"][i, t]))
            r_max = max(r_max, r)
            a = float(d["advantages"][i, t])
            r_clip = min(max(r, 1 - ALG.clip_low), 1 + ALG.clip_high)
            dual += a < 0 and max(-a * r, -a * r_clip) > -a * ALG.dual_clip
    return r_max, dual / n


def partials(d: dict[str, torch.Tensor], rows: slice, n_tok: float, n_seq: float) -> dict[str, torch.Tensor]:
    part = {k: v[rows] for k, v in d.items()}
    _, metrics = RLLoss(ALG, CorrectionConfig(method="tis"), fused=False)(
        part["logprobs"], part, n_tok, n_seq
    )
    return metrics


def test_ratio_max_and_dual_clip_frac_match_the_reference_over_micro_batches() -> None:
    d = batch()
    n_tok, n_seq = float(d["loss_mask"].sum()), float((d["loss_mask"].sum(-1) > 0).sum())
    whole = finalize_metrics(partials(d, slice(None), n_tok, n_seq))
    split = finalize_metrics(
        combine_partials([partials(d, slice(i, i + 2), n_tok, n_seq) for i in (0, 2, 4)])
    )
    r_max, dual = ref_metrics(d)
    assert dual > 0  # the batch exercises the dual clip
    for m in (whole, split):
        assert m["loss/ratio_max"] == pytest.approx(r_max, rel=1e-6)
        assert m["loss/dual_clip_frac"] == pytest.approx(dual, rel=1e-6)


def test_without_a_dual_clip_nothing_is_dual_clipped_and_an_empty_batch_has_no_max() -> None:
    d = batch()
    _, m = RLLoss(AlgorithmConfig(), CorrectionConfig(method="none"), fused=False)(d["logprobs"], d, 10, 2)
    assert m["loss/dual_clip_frac"].item() == 0.0
    empty = dict(d, loss_mask=torch.zeros_like(d["loss_mask"]))
    _, m = RLLoss(ALG, CorrectionConfig(method="none"), fused=False)(d["logprobs"], empty, 0, 0)
    assert math.isnan(finalize_metrics(m)["loss/ratio_max"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, d: dict, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        n_tok, n_seq = float(d["loss_mask"].sum()), float((d["loss_mask"].sum(-1) > 0).sum())
        rows = slice(rank * 3, rank * 3 + 3)
        out[rank] = finalize_metrics(all_reduce_partials(partials(d, rows, n_tok, n_seq)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ratio_max_is_reduced_with_max_across_ranks() -> None:
    d = batch()
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(2, _free_port(), d, out), nprocs=2, join=True, start_method="spawn")
        got = dict(out)
    r_max, dual = ref_metrics(d)
    local = [ref_metrics({k: v[r * 3 : r * 3 + 3] for k, v in d.items()})[0] for r in (0, 1)]
    assert local[0] != local[1]  # a mean of the two would differ from their max
    for rank in (0, 1):
        assert got[rank]["loss/ratio_max"] == pytest.approx(r_max, rel=1e-6)
        assert got[rank]["loss/dual_clip_frac"] == pytest.approx(dual, rel=1e-6)
