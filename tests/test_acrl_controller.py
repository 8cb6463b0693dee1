"""The ACRL controller: reference modes, state round trip, and agreement across gloo ranks."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_acrl.config import CorrectionConfig
from megatron_acrl.correction import (
    AcrlController,
    MismatchTensors,
    acrl_discrepancy_stats,
    combine_partials,
    compute_correction,
    finalize_metrics,
    fused_cpu,
    mismatch_metrics,
)
from megatron_acrl.megatron.collectives import all_reduce_partials

# The kernel a CPU trainer runs by default (correction.kernel=auto): the fused C pass where it builds.
FUSED = fused_cpu.resolve_kernel("auto", "cpu")


def stats(y, n=4):
    return torch.tensor([y * n, float(n)], dtype=torch.float64)


def test_static_reference_from_first_batches():
    c = AcrlController(CorrectionConfig(reference_batches=2))
    s = c.update(stats(0.1))
    assert (s.x, s.y) == pytest.approx((0.1, 0.1))  # first batch: Y = X -> alpha = 0
    s = c.update(stats(0.3))
    assert s.x == pytest.approx(0.2)
    s = c.update(stats(0.5))
    assert (s.x, s.y) == pytest.approx((0.2, 0.5))
    assert c.metrics()["acrl/y_over_x"] == pytest.approx(2.5)


def test_ema_reference_uses_previous_x():
    c = AcrlController(CorrectionConfig(reference="ema", ema_decay=0.5))
    c.update(stats(0.2))
    s = c.update(stats(0.4))
    assert s.x == pytest.approx(0.2)  # controlled against the reference before this batch
    s = c.update(stats(0.4))
    assert s.x == pytest.approx(0.3)


def test_state_dict_round_trip_and_errors():
    cfg = CorrectionConfig(reference="ema")
    a = AcrlController(cfg)
    for y in (0.1, 0.2, 0.15):
        a.update(stats(y))
    b = AcrlController(cfg)
    b.load_state_dict(a.state_dict())
    for y in (0.3, 0.05):
        assert a.update(stats(y)) == b.update(stats(y))
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({"x": 1.0})
    with pytest.raises(RuntimeError, match="first update"):
        AcrlController(cfg).signal()
    with pytest.raises(ValueError, match="no valid sequence"):
        AcrlController(cfg).update(torch.zeros(2))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, lp, lq, mask, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sl = slice(rank * lp.shape[0] // world, (rank + 1) * lp.shape[0] // world)
        n_tok, n_seq = int(mask.sum()), int(mask.any(-1).sum())
        sh = MismatchTensors(lp[sl], lq[sl], mask[sl], fused=FUSED)
        local = acrl_discrepancy_stats(sh, "prob_abs")
        dist.all_reduce(local)
        ctl = AcrlController(CorrectionConfig())
        ctl.update(local)
        part = {
            **mismatch_metrics(sh, num_tokens=n_tok, num_seqs=n_seq),
            **compute_correction(
                CorrectionConfig(method="tis"), sh, num_tokens=n_tok, num_seqs=n_seq
            ).metrics,
        }
        reduced = finalize_metrics(all_reduce_partials(part))
        out[rank] = (ctl.state_dict(), reduced)
    finally:
        dist.destroy_process_group()


def test_all_reduced_stats_give_every_rank_the_same_state():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(6, 7, generator=g) * 2
    lq = lp + 0.3 * torch.randn(6, 7, generator=g)
    lq[2, 1] = lp[2, 1] + 30  # one huge outlier: chi2_seq must still reduce exactly in log space
    mask = torch.rand(6, 7, generator=g) > 0.2
    mask[5] = False
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        mp.start_processes(
            _worker, args=(2, _free_port(), lp, lq, mask, out), nprocs=2, join=True, start_method="spawn"
        )
        results = dict(out)
    ref_ctl = AcrlController(CorrectionConfig())
    sh = MismatchTensors(lp, lq, mask, fused=FUSED)
    ref_ctl.update(acrl_discrepancy_stats(sh, "prob_abs"))
    n_tok, n_seq = int(mask.sum()), int(mask.any(-1).sum())
    whole = finalize_metrics(
        combine_partials(
            [
                mismatch_metrics(sh, num_tokens=n_tok, num_seqs=n_seq),
                compute_correction(
                    CorrectionConfig(method="tis"), sh, num_tokens=n_tok, num_seqs=n_seq
                ).metrics,
            ]
        )
    )
    assert results[0][0] == results[1][0]
    assert results[0][0]["x"] == pytest.approx(ref_ctl.state_dict()["x"])
    for k, v in whole.items():
        assert results[0][1][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
        assert results[1][1][k] == results[0][1][k]
