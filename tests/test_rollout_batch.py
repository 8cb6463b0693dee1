"""Rollout batch assembly, NaN/Inf masking, record and replay."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_acrl.batch.rollout_batch import RolloutBatch, build_batch, load_rollouts, save_rollouts


def make():
    return build_batch(
        [[5, 6], [5, 6], [7]],
        [[1, 2, 3], [4], []],
        [[-0.1, -0.2, -0.3], [float("nan")], []],
        rewards=[1.0, 0.0, 0.5],
        group_ids=[0, 0, 1],
        pad_id=0,
        finish_reasons=["stop", "length", "stop"],
    )


def test_layout_and_alignment():
    b = make()
    assert b.tokens.tolist() == [[5, 6, 1, 2, 3], [5, 6, 4, 0, 0], [7, 0, 0, 0, 0]]
    assert b.loss_mask.tolist()[0] == [0, 0, 1, 1, 1]
    # position t holds log mu(token t | < t)
    assert b.rollout_logprobs[0, 2:].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert b.response_len.tolist() == [3, 1, 0]


def test_nonfinite_logprobs_are_masked_and_counted():
    b = make()
    assert b.num_nonfinite_logprobs == 1
    assert b.loss_mask[1].sum() == 0  # the NaN token is out of the loss
    assert torch.isfinite(b.rollout_logprobs).all()


def test_select_concat_and_replay(tmp_path):
    b = make()
    sub = b.select([0, 2])
    assert sub.rewards.tolist() == [1.0, 0.5] and sub.finish_reasons == ["stop", "stop"]
    both = RolloutBatch.concat([sub, b])
    assert len(both) == 5 and both.tokens.shape[1] == 5
    save_rollouts(b, tmp_path, step=3)
    again = load_rollouts(tmp_path, 3)
    for k, v in b.tensors().items():
        assert torch.equal(v, getattr(again, k))
    with pytest.raises(FileNotFoundError, match="no recorded batch for step 4"):
        load_rollouts(tmp_path, 4)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="log-probs for 2 output tokens"):
        build_batch([[1]], [[1, 2]], [[-1.0]], rewards=[0], group_ids=[0], pad_id=0)
    with pytest.raises(ValueError, match="empty prompt"):
        build_batch([[]], [[1]], [[-1.0]], rewards=[0], group_ids=[0], pad_id=0)
    assert not math.isnan(make().rewards.sum().item())
