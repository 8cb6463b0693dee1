"""Layout invariance of MoE routing replay, in one 4-rank gloo launch (fp32, the ``moe`` model of
``tests/mcore_worker.py``).

A synthetic rollout routing (random valid top-2 sets, -1 on each sequence's last position) is
replayed by the plain data-parallel run (the reference) and by EP, TP+SP+EP and TP+SP+PP layouts (the
last with activation recompute, whose recomputed forwards replay FIFO across the 1F1B warm-up):
pi_old, the routing metrics, the trainer's own routing, the training step's metrics and every
updated parameter must match. R2 (``moe_routing_replay=train``) must equal replay off (it replays the
pi_old pass's own routing). Misaligned replays -- a wrong layer order, a wrong token order -- must
not match: alignment bugs are caught, not silently accepted.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from dist_launch import launch, update_mismatches

pytestmark = pytest.mark.timeout(1800)

WORKER = Path(__file__).with_name("r3_worker.py")
CASES = [
    dict(name="ref_rollout", layout={}, replay="rollout"),
    dict(name="ref_off", layout={}, replay="off"),
    dict(name="ep2", layout=dict(ep=2), replay="rollout"),
    dict(name="ep2_tp2_sp", layout=dict(ep=2, tp=2, sequence_parallel=True), replay="rollout"),
    dict(
        name="tp2_sp_pp2_recompute",
        layout=dict(tp=2, pp=2, sequence_parallel=True),
        replay="rollout",
        recompute="full",
    ),
    dict(name="r2_ep2_tp2_sp", layout=dict(ep=2, tp=2, sequence_parallel=True), replay="train"),
    dict(
        name="NEGATIVE_layer_order",
        layout=dict(tp=2, pp=2, sequence_parallel=True),
        replay="rollout",
        negative="layer_order",
    ),
    dict(
        name="NEGATIVE_token_order",
        layout=dict(ep=2, tp=2, sequence_parallel=True),
        replay="rollout",
        negative="token_order",
    ),
]
REFERENCE = {"rollout": "ref_rollout", "train": "ref_off", "off": "ref_off"}


@pytest.fixture(scope="module")
def ranks():
    return launch("layouts", 4, {"cases": CASES}, timeout=1700, worker=WORKER)


def _compare(ref: dict, got: dict) -> list[str]:
    bad = []
    for section in ("metrics", "routing"):
        for key, value in ref[section].items():
            if "perf/" in key:  # how the batch was cut (micro-batches, DP balance), not what it learned
                continue
            other = got[section].get(key)
            if other is None:
                bad.append(f"{section} {key} missing")
            elif not (math.isnan(value) and math.isnan(other)) and not math.isclose(
                value, other, rel_tol=1e-4, abs_tol=1e-6
            ):
                bad.append(f"{section} {key}: {other} != reference {value}")
    err = (ref["old"] - got["old"]).abs().max().item()
    if err > 1e-4:
        bad.append(f"pi_old differs by {err:.2e}")
    return bad + update_mismatches(ref, got)


@pytest.mark.parametrize(
    "case", [c for c in CASES if not c["name"].startswith("ref")], ids=lambda c: c["name"]
)
def test_replay_is_layout_invariant(ranks, case):
    for rank, res in enumerate(ranks):
        ref = dict(res[REFERENCE[case["replay"]]], init=ranks[0]["ref_rollout"]["init"])
        got = res[case["name"]]
        bad = _compare(ref, got)
        if case.get("negative"):
            assert bad, f"rank {rank}: a misaligned replay ({case['negative']}) matched the reference"
            continue
        assert not bad, f"rank {rank}: " + "; ".join(bad[:8])
        # The training pass replays exactly what pi_old replayed: its first forward equals pi_old.
        assert abs(got["metrics"]["loss/ppo_kl"]) < 1e-6
        # The trainer's own routing (before replay) is assembled over SP, DP and PP identically.
        for layer, own in got["own"].items():
            assert torch.equal(own, res[REFERENCE[case["replay"]]]["own"][layer]), (rank, layer)


def test_replay_changes_the_model_and_is_measured(ranks):
    for res in ranks:
        rollout, off = res["ref_rollout"], res["ref_off"]
        assert (rollout["old"] - off["old"]).abs().max() > 1e-3  # replaying other experts matters
        # random top-2 of 4 experts agrees as a set with the router's own 1/6 of the time
        assert 0.6 < rollout["routing"]["routing/disagree_frac"] < 0.95
        assert rollout["routing"]["routing/decisions"] == 8 * 15 * 4  # last positions are unknown
        for layer in range(4):
            assert f"routing/disagree_frac/layer_{layer}" in rollout["routing"]
