"""A multi-turn batch: observation tokens never reach a mismatch metric or the correction's statistics
(they are out of loss_mask), and the mismatch splits by turn."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_acrl.batch.rollout_batch import build_batch
from megatron_acrl.batch.staleness import turn_metrics
from megatron_acrl.correction import MismatchTensors, finalize_metrics, mismatch_metrics


def _multi_turn():
    # prompt 3 ids; turn 0: 3 generated; observation 2 + boundary 1; turn 1: 2 generated
    out = [10, 11, 12, 20, 21, 22, 13, 14]
    gen = [1, 1, 1, 0, 0, 0, 1, 1]
    turns = [0, 0, 0, -1, -1, -1, 1, 1]
    lp = [-0.1, -0.2, -0.3, 55.0, float("nan"), -1e9, -0.4, -0.5]  # garbage on the observation ids
    b = build_batch(
        [[1, 2, 3]],
        [out],
        [lp],
        rewards=[1.0],
        group_ids=[0],
        pad_id=0,
        generated=[gen],
        turn_ids=[turns],
        token_versions=[[3, 3, 3, -1, -1, -1, 4, 4]],
    )
    return b, gen


def test_observation_ids_have_no_logprob_loss_version_or_turn() -> None:
    b, gen = _multi_turn()
    assert b.loss_mask[0, 3:].tolist() == [float(g) for g in gen]
    assert b.rollout_logprobs[0, 6:9].tolist() == [0.0, 0.0, 0.0] and b.num_nonfinite_logprobs == 0
    assert b.turn_ids[0].tolist() == [-1, -1, -1, 0, 0, 0, -1, -1, -1, 1, 1]
    assert b.token_versions[0].tolist() == [-1, -1, -1, 3, 3, 3, -1, -1, -1, 4, 4]


def test_mismatch_metrics_see_generated_ids_only() -> None:
    b, _ = _multi_turn()
    old = b.rollout_logprobs.clone()
    old[0, 6:9] = torch.tensor([-7.0, 3.0, -2.0])  # the trainer's numbers on observations: anything
    rollout = b.rollout_logprobs.clone()
    rollout[0, 6:9] = torch.tensor([55.0, float("nan"), -1e9])  # garbage the mask must hide
    sh = MismatchTensors(old, rollout, b.loss_mask > 0, fused=False)
    m = finalize_metrics(mismatch_metrics(sh, num_tokens=int(b.loss_mask.sum()), num_seqs=1))
    for k, v in m.items():
        assert math.isfinite(v), k
    assert m["mismatch/k3_kl"] == pytest.approx(0.0, abs=1e-7)


def test_mismatch_splits_by_turn() -> None:
    b, _ = _multi_turn()
    old = b.rollout_logprobs.clone()
    old[0, 9:11] += 0.5  # only turn 1 drifts
    m = turn_metrics(b.turn_ids, b.loss_mask, old, b.rollout_logprobs)
    assert m["mismatch_turn/0/k3_kl"] == pytest.approx(0.0, abs=1e-7)
    assert m["mismatch_turn/1/k3_kl"] > 0.05 and m["mismatch_turn/1/kl"] == pytest.approx(-0.5)
    single = build_batch([[1, 2]], [[5, 6]], [[-0.1, -0.2]], rewards=[0.0], group_ids=[0], pad_id=0)
    assert (
        turn_metrics(single.turn_ids, single.loss_mask, single.rollout_logprobs, single.rollout_logprobs)
        == {}
    )


def test_the_driver_logs_the_mismatch_by_turn_only_for_multi_turn_batches() -> None:
    import torch

    from megatron_acrl.train import drift_metrics

    mask = torch.tensor([[0, 1, 1, 0, 1, 1]], dtype=torch.float32)
    old = torch.tensor([[0.0, -1.0, -1.0, 0.0, -2.0, -2.0]])
    mu = torch.tensor([[0.0, -1.0, -1.0, 0.0, -1.5, -1.5]])
    multi = {"loss_mask": mask, "old_logprobs": old, "rollout_logprobs": mu}
    multi["turn_ids"] = torch.tensor([[-1, 0, 0, -1, 1, 1]])
    m = drift_metrics(multi, trainer_version=0)  # type: ignore[arg-type]
    assert any(k.startswith("mismatch_turn/1/") for k in m) and any(
        k.startswith("mismatch_turn/0/") for k in m
    )
    single = dict(multi, turn_ids=torch.tensor([[-1, 0, 0, -1, 0, 0]]))
    assert not any(k.startswith("mismatch_turn/") for k in drift_metrics(single, trainer_version=0))  # type: ignore[arg-type]
