"""Issue #34: the drift-budget step controller (``correction.step_control: drift_budget``): its law
against a float64 reference, its statistics, its state, and (gloo, 2 ranks) the scale reaching the
optimizer's param groups alike on every rank, restored after the step, and a resume of its state."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from dist_launch import launch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_acrl.config import ConfigError, CorrectionConfig, config_from_dict
from megatron_acrl.correction import DriftBudgetController, MismatchTensors, drift_stats, fused_cpu

CFG = CorrectionConfig(step_control="drift_budget", step_kappa=4.0, step_budget_min=1e-3, step_scale_min=0.1)


def ref_scales(
    drifts: list[tuple[float, float | None]], kappa: float, b_min: float, s_min: float
) -> list[float]:
    """``s_t = clip(sqrt(B / D_t), s_min, 1)``, ``B = max(kappa D_ref, B_min)``, D_ref the first
    lag-0 drift given (``None``: the batch has no lag-0 token), in float64 Python."""
    ref, out = None, []
    for d, d0 in drifts:
        if ref is None and d0 is not None:
            ref = d0
        b = max(kappa * (ref or 0.0), b_min)
        out.append(1.0 if d <= 0 else min(1.0, max(s_min, math.sqrt(b / d))))
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 5), st.one_of(st.none(), st.floats(0, 0.1))), min_size=1, max_size=12),
    st.floats(0.5, 10),
    st.floats(1e-6, 1e-1),
    st.floats(0.01, 1),
)
def test_the_scale_follows_the_law(drifts, kappa, b_min, s_min) -> None:
    cfg = dataclasses.replace(CFG, step_kappa=kappa, step_budget_min=b_min, step_scale_min=s_min)
    ctrl = DriftBudgetController(cfg)
    got = [
        ctrl.update((d * 10, 10.0, 0.0 if d0 is None else d0 * 3, 0.0 if d0 is None else 3.0))
        for d, d0 in drifts
    ]
    assert got == pytest.approx(ref_scales(drifts, kappa, b_min, s_min), rel=1e-12, abs=0)


def test_without_lag_the_scale_stays_one_and_metrics_are_the_documented_keys() -> None:
    ctrl = DriftBudgetController(CFG)
    assert ctrl.metrics() == {}
    for d in (0.002, 0.003, 0.0025, 0.0):  # drift near the lag-0 reference: never over 4x of it
        assert (
            ctrl.update((d * 100, 100.0, d * 100, 100.0) if ctrl.reference is None else (d, 1.0, 0.0, 0.0))
            == 1.0
        )
    m = ctrl.metrics()
    assert set(m) == {
        "step_control/scale",
        "step_control/budget",
        "step_control/drift",
        "step_control/reference",
    }
    assert m["step_control/reference"] == 0.002 and m["step_control/budget"] == pytest.approx(0.008)


def test_a_stale_batch_is_scaled_down_to_the_floor_at_most() -> None:
    ctrl = DriftBudgetController(CFG)
    ctrl.update((0.01, 1.0, 0.01, 1.0))  # D_ref = 0.01: B = 0.04
    assert ctrl.update((0.16, 1.0, 0.0, 0.0)) == pytest.approx(0.5)  # sqrt(0.04 / 0.16)
    assert ctrl.update((400.0, 1.0, 0.0, 0.0)) == 0.1  # floored at s_min
    with pytest.raises(ValueError, match="not finite"):
        ctrl.update((math.nan, 1.0, 0.0, 0.0))


def test_before_any_lag0_token_the_floor_is_the_budget() -> None:
    ctrl = DriftBudgetController(CFG)
    assert ctrl.update((0.004, 1.0, 0.0, 0.0)) == pytest.approx(0.5)  # sqrt(1e-3 / 4e-3)
    assert math.isnan(ctrl.metrics()["step_control/reference"])


def test_state_round_trip_resumes_exactly_and_refuses_others() -> None:
    a = DriftBudgetController(CFG)
    seq = [(0.01, 1.0, 0.01, 1.0), (0.3, 1.0, 0.0, 0.0), (0.05, 1.0, 0.0, 0.0), (2.0, 1.0, 0.0, 0.0)]
    for s in seq[:2]:
        a.update(s)
    b = DriftBudgetController(CFG)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert [a.update(s) for s in seq[2:]] == [b.update(s) for s in seq[2:]]
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({"version": 1})
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict(dict(a.state_dict(), version=99))


@pytest.mark.parametrize("fused", [False, True] if fused_cpu.available() else [False])
def test_drift_stats_are_the_token_sums_of_k3(fused: bool) -> None:
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 2
    lq = lp + 0.3 * torch.randn(4, 7, generator=g, dtype=torch.float64)
    mask = torch.arange(7) < torch.tensor([7, 3, 0, 5])[:, None]
    lag0 = mask & (torch.arange(7) < 2)
    sh = MismatchTensors(lp.float(), lq.float(), mask, fused=fused)
    got = drift_stats(sh, MismatchTensors(lp.float(), lq.float(), lag0, fused=fused))
    d = lp.float().double() - lq.float().double()  # log rho of the float32 inputs
    k3 = torch.exp(d) - 1 - d
    want = [k3[mask].sum().item(), float(mask.sum()), k3[lag0].sum().item(), float(lag0.sum())]
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(want, rel=1e-5)


def test_the_knobs_are_validated() -> None:
    for bad in (
        {"step_kappa": 0.0},
        {"step_budget_min": 0.0},
        {"step_scale_min": 0.0},
        {"step_scale_min": 1.5},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            CorrectionConfig(step_control="drift_budget", **bad)
    with pytest.raises(ConfigError, match="step_control"):
        config_from_dict({"correction": {"step_control": "lr_budget"}})


@pytest.mark.slow
def test_the_scale_reaches_the_optimizer_on_every_rank_and_resumes(tmp_path) -> None:
    ranks = launch("step_control", 2, {"tmp": str(tmp_path)}, timeout=900, worker=_worker())
    r0 = ranks[0]
    assert r0["scale"] < 1.0  # the stale batch is scaled down
    for r in ranks:
        assert r["lrs_in_step"] == pytest.approx([lr * r0["scale"] for lr in r0["lrs_before"]], rel=1e-12)
        assert r["lrs_before"] == r0["lrs_before"] and r["scale"] == r0["scale"]
        assert r["lrs_after"] == r["lrs_sched"]  # restored: the schedule is the unscaled run's
        assert r["metrics"]["lr"] == pytest.approx(r0["lrs_before"][0] * r0["scale"])
        assert r["metrics"]["step_control/scale"] == r0["scale"]
        assert r["resumed"] == r["state"]  # the checkpoint holds the controller's state
        assert r["lag0_scale"] == 1.0
        both, acrl = r["both"]["both"], r["both"]["acrl"]
        assert both["m1"]["acrl/y"] == acrl["m1"]["acrl/y"]  # ACRL's controller unchanged beside it
        assert both["m1"]["step_control/scale"] < 1.0 and "step_control/scale" not in acrl["m1"]
        assert acrl["scale"] == 1.0 and acrl["metrics"]["lr"] == acrl["lr"]
        assert both["metrics"]["lr"] == pytest.approx(both["lr"] * both["scale"])
        # A checkpoint from before step control resumes with it on: ACRL's state restored, the step
        # controller fresh (no reference yet, scale 1) and measured anew from the next lag-0 batch.
        pre = r["both"]["pre_step_resumed"]
        assert pre["acrl"] == r["both"]["acrl_state"]
        assert (pre["step"]["num_updates"], pre["step"]["reference"], pre["step"]["scale"]) == (0, None, 1.0)
        assert pre["lr_scale"] == 1.0


def _worker():
    from pathlib import Path

    return Path(__file__).with_name("step_control_worker.py")
