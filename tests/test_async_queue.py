"""The async producer's pure parts: the staleness-bounded group queue, the per-token version
contract, the drift metrics (against float64 references) and the metrics rows a resume forgets."""

from __future__ import annotations

import json
import random

import pytest
import torch
from reference import ref_mismatch

from megatron_acrl.batch.rollout_batch import RolloutBatch, build_batch
from megatron_acrl.batch.staleness import staleness_metrics
from megatron_acrl.logging import supersede_rows_after
from megatron_acrl.rollout.group_queue import GroupQueue
from megatron_acrl.tasks.base import Prompt


def group_batch(gid: int, versions: list[int], reward: float = 1.0, n: int = 2) -> RolloutBatch:
    """A finished group of ``n`` one-prompt samples whose tokens carry ``versions``."""
    return build_batch(
        [[1, 2]] * n,
        [[3] * len(versions)] * n,
        [[-0.5] * len(versions)] * n,
        rewards=[reward] * n,
        group_ids=[gid] * n,
        pad_id=0,
        token_versions=[versions] * n,
    )


def simulate(queue: GroupQueue, steps: int, seed: int, lag: int = 0) -> list[list[int]]:
    """Drive the queue like the engine and the loop do, with random completion order and times:
    returns, per step, the lag of each trained group's oldest token."""
    rng = random.Random(seed)
    served, gid, in_flight, out = 0, 0, [], []
    for step in range(steps):
        while True:
            for _ in range(queue.capacity(served)):  # admit what the bound allows
                queue.admit(gid, Prompt("p", "a", gid), served)
                in_flight.append((gid, served))
                gid += 1
            taken = queue.take(step)
            if taken is not None:
                break
            assert in_flight, f"step {step}: waiting with nothing in flight (deadlock)"
            rng.shuffle(in_flight)  # some request finishes, generated partly on newer weights
            g, admitted = in_flight.pop()
            queue.finish(g, group_batch(g, [admitted, max(admitted, served)]))
        out.append([step - g.oldest_version for g in taken.groups])
        served = max(0, step + 1 - lag)  # the update: the servers now serve version t + 1 - L
        for _ in range(rng.randrange(3)):  # some generation overlaps the next step's wait
            if in_flight:
                g, admitted = in_flight.pop(rng.randrange(len(in_flight)))
                queue.finish(g, group_batch(g, [admitted, served]))
    return out


@pytest.mark.parametrize("k,lag", [(1, 0), (2, 0), (3, 1), (2, 2)])
@pytest.mark.parametrize("seed", range(4))
def test_wait_policy_never_trains_a_token_older_than_k(k, lag, seed):
    q = GroupQueue(batch_groups=3, max_staleness=k)
    lags = simulate(q, steps=25, seed=seed, lag=lag)
    assert all(len(s) == 3 for s in lags)  # every step a full batch
    assert max(x for s in lags for x in s) <= k
    assert q.dropped_stale == 0


def test_admission_allows_k_batches_ahead_and_no_more():
    q = GroupQueue(batch_groups=2, max_staleness=1)
    assert q.capacity(served_version=0) == 4  # batches 0 and 1 while version 0 is served
    for g in range(4):
        q.admit(g, Prompt("p", "a", g), 0)
    assert q.capacity(0) == 0
    for g in (3, 2):  # the later groups finish first
        q.finish(g, group_batch(g, [0]))
    taken = q.take(0)
    assert taken is not None and [g.gid for g in taken.groups] == [2, 3]
    # 0 and 1 (deadline 1) can still make step 1; version 1 admits step 2's groups
    assert q.capacity(0) == 0 and q.capacity(1) == 2
    q.admit(4, Prompt("p", "a", 4), 1)
    assert q.take(1) is None  # groups 0 and 1 are due at step 1 and still in flight
    q.finish(4, group_batch(4, [1]))
    assert q.take(1) is None
    q.finish(0, group_batch(0, [0]))
    q.finish(1, group_batch(1, [0, 1]))
    assert [g.gid for g in q.take(1).groups] == [0, 1]
    with pytest.raises(ValueError, match="not 1"):
        q.take(1)


def test_a_later_group_is_not_taken_when_an_earlier_one_would_then_miss_its_deadline():
    q = GroupQueue(batch_groups=1, max_staleness=2)
    q.admit(0, Prompt("p", "a", 0), 0)  # deadline 2
    q.admit(1, Prompt("p", "a", 1), 0)  # deadline 2
    q.admit(2, Prompt("p", "a", 2), 0)  # deadline 2
    q.finish(2, group_batch(2, [0]))
    assert [g.gid for g in q.take(0).groups] == [2]  # 0 and 1 can still make steps 1 and 2
    q.finish(1, group_batch(1, [0]))
    assert [g.gid for g in q.take(1).groups] == [1]
    assert q.take(2) is None  # group 0 is due: wait for it
    q.finish(0, group_batch(0, [0]))
    assert [g.gid for g in q.take(2).groups] == [0]


def test_drop_policy_keeps_admitting_and_drops_what_is_too_old():
    q = GroupQueue(batch_groups=1, max_staleness=1, policy="drop")
    assert q.capacity(served_version=0) == 2 and q.capacity(served_version=9) == 2
    q.admit(0, Prompt("p", "a", 0), 0)
    q.admit(1, Prompt("p", "a", 1), 0)
    q.finish(1, group_batch(1, [0]))
    assert [g.gid for g in q.take(0).groups] == [1]
    q.finish(0, group_batch(0, [0]))  # finished late: version 0 at step 2 is 2 old
    q.next_step = 2
    q.admit(2, Prompt("p", "a", 2), 2)
    assert q.take(2) is None and q.dropped_stale == 1 and 0 not in q.live
    q.finish(2, group_batch(2, [2]))
    assert [g.gid for g in q.take(2).groups] == [2]


def test_dynamic_sampling_refills_then_tops_up_with_dropped_groups():
    q = GroupQueue(batch_groups=2, max_staleness=1, dynamic_sampling=True, refill_groups=2)
    for g in range(4):
        q.admit(g, Prompt("p", "a", g), 0)
    q.finish(0, group_batch(0, [0]), keep=False)  # all-equal rewards: dropped, its place freed
    q.finish(1, group_batch(1, [0]), keep=True)
    assert 0 not in q.live and q.capacity(0) == 1
    q.finish(2, group_batch(2, [0]), keep=False)  # the refill budget (2) is spent now
    assert not q.filtering
    taken = q.take(0)  # one kept group + one dropped group as the top-up (zero advantage)
    assert taken is not None and [g.gid for g in taken.groups] == [0, 1] and taken.topped_up == 1
    assert q.filtering  # a new step, a new budget


def test_pending_groups_are_what_a_resume_regenerates():
    q = GroupQueue(batch_groups=1, max_staleness=2)
    for g in (5, 3, 4):
        q.admit(g, Prompt("p", "a", g), 0)
    q.finish(4, group_batch(4, [0]))
    assert [g.gid for g in q.pending()] == [3, 4, 5]


def test_token_versions_in_the_batch_contract(tmp_path):
    a = group_batch(0, [1, 2, 2])
    b = group_batch(1, [3])
    assert a.token_versions.tolist()[0] == [-1, -1, 1, 2, 2]  # prompt positions hold -1
    both = RolloutBatch.concat([a, b])
    assert both.token_versions.tolist()[-1] == [-1, -1, 3, -1, -1]  # padding holds -1
    assert both.select([2]).token_versions.tolist() == [[-1, -1, 3, -1, -1]]
    assert "token_versions" in both.tensors()
    both.save(tmp_path / "b.pt")
    assert torch.equal(RolloutBatch.load(tmp_path / "b.pt").token_versions, both.token_versions)
    old = build_batch([[1]], [[2]], [[-0.1]], rewards=[0.0], group_ids=[0], pad_id=0)
    assert old.token_versions is None and "token_versions" not in old.tensors()
    with pytest.raises(ValueError, match="with and without token_versions"):
        RolloutBatch.concat([old, b])
    with pytest.raises(ValueError, match="2 token versions for 3 output tokens"):
        build_batch(
            [[1]], [[2, 3, 4]], [[0.0] * 3], rewards=[0], group_ids=[0], pad_id=0, token_versions=[[1, 1]]
        )


def test_drift_metrics_match_float64_references():
    g = torch.Generator().manual_seed(0)
    n, length, step = 6, 9, 5
    mask = (torch.rand(n, length, generator=g) > 0.3).float()
    mask[:, 0] = 0
    versions = torch.randint(2, 6, (n, length), generator=g)
    versions[mask == 0] = -1
    versions[0][mask[0] > 0] = 5  # one sequence entirely fresh
    old = -torch.rand(n, length, generator=g) * 3
    roll = old + 0.2 * torch.randn(n, length, generator=g)
    m = staleness_metrics(versions, mask, old, roll, trainer_version=step)
    lag = [[step - int(versions[i, t]) for t in range(length) if mask[i, t]] for i in range(n)]
    flat = [x for row in lag for x in row]
    per_seq = [max(row) for row in lag if row]
    assert m["async/staleness_mean"] == pytest.approx(sum(per_seq) / len(per_seq))
    assert m["async/staleness_max"] == max(per_seq)
    assert m["async/token_lag_mean"] == pytest.approx(sum(flat) / len(flat))
    for k in range(4):
        assert m[f"async/lag_frac/{k}"] == pytest.approx(flat.count(k) / len(flat))
    for prefix, keep in (("mismatch_lag0/", lambda x: x == 0), ("mismatch_lag1plus/", lambda x: x >= 1)):
        sub = torch.tensor(
            [[bool(mask[i, t]) and keep(step - int(versions[i, t])) for t in range(length)] for i in range(n)]
        )
        ref = ref_mismatch(old, roll, sub)
        for key, value in ref.items():
            assert m[prefix + key] == pytest.approx(value, rel=1e-4, abs=1e-6), prefix + key
    with pytest.raises(ValueError, match="newer than the trainer"):
        staleness_metrics(versions, mask, old, roll, trainer_version=3)
    assert staleness_metrics(versions, torch.zeros_like(mask), old, roll, trainer_version=step) == {}


def test_a_resume_forgets_the_metrics_rows_after_its_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3, 4)))
    assert supersede_rows_after(path, 2) == 2  # kept aside in metrics.superseded.jsonl (test_logging.py)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    assert supersede_rows_after(path, 2) == 0 and supersede_rows_after(tmp_path / "none.jsonl", 0) == 0
