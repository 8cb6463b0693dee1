"""The ACRL controller: reference modes, state round trip, and agreement across gloo ranks."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ref_controller

from megatron_acrl.config import ConfigError, CorrectionConfig
from megatron_acrl.correction import (
    AcrlController,
    MismatchTensors,
    acrl_coefficient,
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


def test_controller_edges_inputs_messages_and_the_first_warning():
    """Sums as a tuple or a tensor, a batch of one sequence, the text of each refusal, the deferred
    signal's X (the documented default floor of prob_abs, 1e-5), and a warning on the first batch."""
    cfg = CorrectionConfig(method="acrl")
    for sums in ((0.3, 2.0), torch.tensor([0.3, 2.0], dtype=torch.float64)):
        sig = AcrlController(cfg).update(sums)
        assert (sig.x, sig.y) == pytest.approx((0.15, 0.15)) and not sig.deferred
    one = AcrlController(cfg).update((0.02, 1.0))  # one valid sequence is a batch
    assert one.y == pytest.approx(0.02) and not one.deferred
    with pytest.raises(RuntimeError, match=r"^AcrlController\.signal\(\) before the first update\(\)"):
        AcrlController(cfg).signal()
    with pytest.raises(ValueError, match=r"^ACRL update with no valid sequence"):
        AcrlController(cfg).update((0.0, 0.0))
    with pytest.raises(ValueError, match=r"^ACRL discrepancy is not finite \(Y=nan\)"):
        AcrlController(cfg).update((math.nan, 2.0))
    deferred = AcrlController(cfg).update((0.0, 4.0))
    assert deferred.deferred and deferred.x == 1e-5
    ctl = AcrlController(cfg)
    ctl.update((0.04, 4.0))
    assert ctl.check_weights({"correction/weight_max": 500.0, "correction/weight_min": 0.9}) is not None


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 1e-9, 2e-6, 3e-5, 0.002, 0.01, 0.05, 0.3]), min_size=1, max_size=8),
    st.sampled_from(["static", "ema"]),
    st.integers(1, 3),
    st.sampled_from([None, 0.0, 1e-3]),
)
def test_controller_follows_the_reference_law(ys, reference, batches, reference_min):
    """X, Y and the coefficient gamma (1 - Y / X) of every batch, against the law written out in
    tests/reference.py (deferral below the floor, static or EMA reference, the floor of X)."""
    cfg = CorrectionConfig(
        gamma=0.7, reference=reference, reference_batches=batches, ema_decay=0.8, reference_min=reference_min
    )
    ctl = AcrlController(cfg)
    floor = ctl.floor
    assert floor == (1e-5 if reference_min is None else reference_min)  # prob_abs's default
    want = ref_controller(
        ys, gamma=0.7, reference=reference, reference_batches=batches, ema_decay=0.8, floor=floor
    )
    for y, (x_ref, c_ref) in zip(ys, want, strict=True):
        sig = ctl.update(stats(y))
        assert sig.y == pytest.approx(y)
        assert sig.deferred == (x_ref is None)
        if x_ref is not None:
            assert sig.x == pytest.approx(x_ref, rel=1e-12)
        coef = acrl_coefficient(cfg, sig, None)
        assert coef == pytest.approx(c_ref, rel=1e-9, abs=1e-12)


def _weights_under(cfg, sig, scale=0.3):
    g = torch.Generator().manual_seed(3)
    lq = -torch.rand(6, 40, generator=g) * 2 - 0.1
    lp = lq + scale * torch.randn(6, 40, generator=g)
    mask = torch.ones(6, 40, dtype=torch.bool)
    adv = torch.randn(6, 1, generator=g)
    sh = MismatchTensors(lp, lq, mask, fused=FUSED)
    corr = compute_correction(cfg, sh, num_tokens=240, num_seqs=6, advantages=adv, acrl=sig)
    return corr.weights, finalize_metrics(corr.metrics)


def test_a_first_batch_without_mismatch_defers_the_reference(caplog):
    """X = 0 from an exact first batch floored Y/X at 1/eps and cut 38% of the weights at e^+-20
    without a word; now the reference waits for a measurable batch, and the paper's law (reference_min
    = 0), still available, is reported and warned about."""
    cfg = CorrectionConfig(method="acrl")
    ctl = AcrlController(cfg)
    sig = ctl.update(stats(0.0))  # bf16 rollout, or a lag whose first step is exact
    assert sig.deferred and ctl.metrics()["acrl/reference_deferred"] == 1.0 and "acrl/x" not in ctl.metrics()
    w, m = _weights_under(cfg, sig)
    assert torch.equal(w, torch.ones_like(w)) and m["acrl/saturated_frac"] == 0  # alpha = 0
    sig = ctl.update(stats(0.01))  # the first measurable batch becomes X
    assert not sig.deferred and sig.x == pytest.approx(0.01) and acrl_coefficient(cfg, sig, None) == 0
    assert ctl.update(stats(0.02)).x == pytest.approx(0.01)
    assert ctl.check_weights(_weights_under(cfg, ctl.signal())[1]) is None

    paper = dataclasses.replace(cfg, reference_min=0.0)
    ctl = AcrlController(paper)
    ctl.update(stats(0.0))
    sig = ctl.update(stats(0.01))  # Y / X = 0.01 / eps
    _, m = _weights_under(paper, sig)
    assert m["acrl/saturated_frac"] > 0.3 and m["correction/weight_max"] == pytest.approx(
        math.exp(20), rel=1e-5
    )
    with caplog.at_level(logging.WARNING, logger="megatron_acrl.correction.acrl"):
        msg = ctl.check_weights(m)
    assert msg is not None and "cut at e^+-20" in msg and "correction.alpha_max" in msg
    assert msg in caplog.text
    assert ctl.check_weights(m) is None  # once per rollout batch


def test_a_growing_mismatch_warns_before_the_weights_explode():
    """Y 20x over X: gamma (1 - Y / X) = -12.35, weights of 1e2-1e4 (the paper's law): warned."""
    cfg = CorrectionConfig(method="acrl")
    ctl = AcrlController(cfg)
    ctl.update(stats(0.01))
    sig = ctl.update(stats(0.2))
    _, m = _weights_under(cfg, sig)
    assert m["correction/weight_max"] > 100 and m["acrl/saturated_frac"] == 0
    assert "beyond [1/100, 100]" in ctl.check_weights(m)
    bounded = dataclasses.replace(cfg, alpha_max=1.0)  # the fix the warning names
    ctl = AcrlController(bounded)
    ctl.update(stats(0.01))
    _, m = _weights_under(bounded, ctl.update(stats(0.2)))
    assert ctl.check_weights(m) is None


@pytest.mark.parametrize("changed", [{"distance": "k3"}, {"reference": "ema"}])
def test_resume_refuses_a_reference_of_another_distance_or_mode(changed):
    """load_state_dict ignored the saved mode and the distance was not saved: a resume with another
    correction.distance compared a new-distance Y with an old-distance X."""
    a = AcrlController(CorrectionConfig())
    for y in (0.02, 0.03):
        a.update(stats(y))
    state = a.state_dict()
    assert (state["distance"], state["reference"]) == ("prob_abs", "static")
    key = next(iter(changed))
    b = AcrlController(CorrectionConfig(**changed))
    with pytest.raises(ConfigError, match=rf"correction\.{key}.*remeasure_reference_on_resume=true"):
        b.load_state_dict(state)
    c = AcrlController(CorrectionConfig(**changed, remeasure_reference_on_resume=True))
    c.load_state_dict(state)
    assert c.signal().deferred and c.num_updates == 2  # a new X, measured from the next batch
    assert c.update(stats(0.5)).x == pytest.approx(0.5)
    same = AcrlController(CorrectionConfig())
    same.load_state_dict(state)
    assert same.update(stats(0.04)) == a.update(stats(0.04))


def test_a_version_1_state_still_loads():
    v1 = {"version": 1, "num_updates": 3, "ref_sum": 0.02, "x": 0.02, "y": 0.05, "x_next": 0.02,
          "reference": "static"}  # fmt: skip
    ctl = AcrlController(CorrectionConfig())
    ctl.load_state_dict(v1)
    assert ctl.update(stats(0.04)).x == pytest.approx(0.02)
    with pytest.raises(ConfigError, match=r"correction\.reference"):
        AcrlController(CorrectionConfig(reference="ema")).load_state_dict(v1)


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


def test_check_weights_trips_only_beyond_its_band_and_names_the_fixes(caplog):
    """The band is open: a weight of exactly warn_weight (or 1/warn_weight) is not a trip; either end
    alone trips; missing metrics never do; the message gives the figures and every fix by its field."""
    ctl = AcrlController(CorrectionConfig(method="acrl", warn_weight=100.0))
    ctl.update(stats(0.01))
    ctl.update(stats(0.02))
    quiet = [
        {},
        {"acrl/saturated_frac": 0.0},
        {"correction/weight_max": 100.0, "correction/weight_min": 0.01},
        {"correction/weight_max": 50.0, "correction/weight_min": 0.015},
        {"correction/weight_max": 50.0},
        {"correction/weight_min": 0.5},
    ]
    for m in quiet:
        assert ctl.check_weights(m) is None, m
    with caplog.at_level(logging.WARNING, logger="megatron_acrl.correction.acrl"):
        msg = ctl.check_weights({"correction/weight_max": 100.5, "correction/weight_min": 0.5})
    assert msg == (
        "ACRL: weights reach [0.5, 100], beyond [1/100, 100] (Y/X = 2, X = 0.01, Y = 0.02, gamma = 0.65). "
        "The paper's law rho^(gamma sign(A) (1 - Y/X)) is unbounded when Y >> X: bound it "
        "(correction.alpha_max, correction.weight_high), lower correction.gamma, let X follow the mismatch "
        "(correction.reference=ema), or raise correction.reference_min if X was measured from a batch "
        "with almost no mismatch"
    )
    assert caplog.records[-1].getMessage() == msg
    ctl.update(stats(0.02))
    msg = ctl.check_weights({"acrl/saturated_frac": 0.25, "correction/weight_min": 0.001})
    assert msg.startswith(
        "ACRL: 25.00% of the tokens have their weight cut at e^+-20; weights reach [0.001, nan], beyond "
        "[1/100, 100] (Y/X = 2"
    )


def test_controller_metrics_and_state_are_exactly_the_documented_keys():
    ctl = AcrlController(CorrectionConfig(method="acrl", gamma=0.5, reference_batches=2))
    assert ctl.metrics() == {}
    ctl.update(stats(0.0))  # deferred: no X yet
    assert ctl.metrics() == {"acrl/y": 0.0, "acrl/gamma": 0.5, "acrl/reference_deferred": 1.0}
    assert ctl.state_dict() == {
        "version": 2, "num_updates": 1, "ref_count": 0, "ref_sum": 0.0, "x": None, "y": 0.0,
        "x_next": None, "reference": "static", "distance": "prob_abs",
    }  # fmt: skip
    ctl.update(stats(0.02))
    ctl.update(stats(0.04))
    assert ctl.metrics() == pytest.approx(
        {
            "acrl/y": 0.04,
            "acrl/gamma": 0.5,
            "acrl/reference_deferred": 0.0,
            "acrl/x": 0.03,
            "acrl/y_over_x": 4 / 3,
        }
    )
    assert ctl.state_dict()["ref_count"] == 2 and ctl.state_dict()["ref_sum"] == pytest.approx(0.06)


def test_a_resume_inside_the_reference_window_keeps_measuring(caplog):
    """Saved after 1 of 3 reference batches, the resumed controller averages the next ones into X
    exactly as the uninterrupted one does; states holding None (never or not yet measured) load too."""
    cfg = CorrectionConfig(method="acrl", reference_batches=3)
    a = AcrlController(cfg)
    a.update(stats(0.02))
    b = AcrlController(cfg)
    b.load_state_dict(a.state_dict())
    assert (b.ref_count, b.ref_sum, b.x, b._x_next, b.y) == (1, 0.02, 0.02, 0.02, 0.02)
    for y in (0.04, 0.09, 0.5):
        assert b.update(stats(y)) == a.update(stats(y))
    never = AcrlController(cfg)
    never.load_state_dict(AcrlController(cfg).state_dict())  # y, x and x_next are None
    assert never.y is None and never.x is None and never._x_next is None and never.ref_count == 0
    deferred = AcrlController(cfg)
    deferred.update(stats(0.0))
    c = AcrlController(cfg)
    c.load_state_dict(deferred.state_dict())
    assert c.x is None and c.signal().deferred
    with pytest.raises(ValueError) as err:
        c.load_state_dict({**deferred.state_dict(), "version": 7})
    assert str(err.value) == "ACRL controller state version 7 != 2"
    with pytest.raises(ValueError) as err:
        c.load_state_dict({"x": 1.0, "y": 1.0})
    assert str(err.value) == (
        "ACRL controller state is missing ['num_updates', 'ref_sum', 'version', 'x_next']; "
        "not a controller checkpoint"
    )
    re = AcrlController(dataclasses.replace(cfg, remeasure_reference_on_resume=True))
    with caplog.at_level(logging.WARNING, logger="megatron_acrl.correction.acrl"):
        re.load_state_dict(a.state_dict())
    assert caplog.records[-1].getMessage() == (
        "ACRL: correction.remeasure_reference_on_resume: measuring a new reference X"
    )


def test_resume_messages_name_the_field_and_both_fixes(caplog):
    a = AcrlController(CorrectionConfig())
    a.update(stats(0.02))
    with pytest.raises(ConfigError) as err:
        AcrlController(CorrectionConfig(distance="k3")).load_state_dict(a.state_dict())
    assert err.value.errors == [
        (
            "correction.distance",
            "the checkpoint's ACRL reference X was measured with distance='prob_abs', this run has 'k3', "
            "and X is not comparable with the new Y: set correction.distance=prob_abs to resume as it "
            "was, or correction.remeasure_reference_on_resume=true to measure a new X",
        )
    ]
    v1 = {k: v for k, v in a.state_dict().items() if k not in ("distance", "reference")}
    with caplog.at_level(logging.WARNING, logger="megatron_acrl.correction.acrl"):
        AcrlController(CorrectionConfig()).load_state_dict({**v1, "version": 1})
    assert [r.getMessage() for r in caplog.records[-2:]] == [
        "ACRL: the checkpoint does not record correction.distance; assuming 'prob_abs'",
        "ACRL: the checkpoint does not record correction.reference; assuming 'static'",
    ]


def test_a_resume_after_deferred_batches_keeps_its_count_of_measured_ones():
    """Two deferred batches then one measured: 3 updates, 1 measured batch. The resumed controller
    measures 2 more into X (reference_batches = 3), as the uninterrupted one does."""
    cfg = CorrectionConfig(method="acrl", reference_batches=3)
    a = AcrlController(cfg)
    for y in (0.0, 0.0, 0.02):
        a.update(stats(y))
    b = AcrlController(cfg)
    b.load_state_dict(a.state_dict())
    assert b.ref_count == 1 and b.num_updates == 3
    for y in (0.04, 0.06, 0.5):
        assert b.update(stats(y)) == a.update(stats(y))
    assert b.signal().x == pytest.approx(0.04)


def test_the_reference_waits_for_the_runs_own_lag():
    """Async K = 1 (or a weight lag L): the first batch is sampled at lag 0, every later one at lag
    >= 1; an X measured on lag 0 made Y/X 6-50 for the rest of the demo. With reference_lag = 1 the
    lag-0 batch is deferred (alpha = 0) and the first lag-1 batch becomes X; a batch of unknown lag
    (a recording without versions) is measured as before."""
    cfg = CorrectionConfig(method="acrl")
    ctl = AcrlController(cfg, reference_lag=1)
    assert ctl.update(stats(0.001), lag=0).deferred
    sig = ctl.update(stats(0.03), lag=1)
    assert not sig.deferred and sig.x == pytest.approx(0.03)
    assert ctl.update(stats(0.06), lag=1).y_over_x(cfg.eps) == pytest.approx(2.0)
    assert AcrlController(cfg, reference_lag=1).update(stats(0.001), lag=None).x == pytest.approx(0.001)
    assert AcrlController(cfg).update(stats(0.001), lag=0).x == pytest.approx(0.001)  # the paper's law


DEMO = os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml")


def test_the_default_reference_lag_is_the_runs_lag():
    from megatron_acrl.config import load_config
    from megatron_acrl.megatron.policy import batch_lag

    def lag(*overrides: str) -> int:
        return load_config(DEMO, list(overrides)).acrl_reference_lag

    assert lag() == 0
    assert lag("rollout.mode=async", "rollout.max_staleness=2") == 1
    assert lag("rollout.weight_lag_steps=8") == 8
    assert lag("rollout.weight_lag_steps=8", "correction.reference_lag=0") == 0
    with pytest.raises(ConfigError, match="reference_lag"):
        load_config(DEMO, ["correction.reference_lag=-1"])
    versions = torch.tensor([[-1, 3, 4], [-1, 5, 5]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    assert batch_lag({"token_versions": versions, "loss_mask": mask}, trainer_version=5) == 2
    assert batch_lag({"loss_mask": mask}, trainer_version=5) is None
