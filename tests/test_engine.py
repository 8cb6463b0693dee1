"""The async producer and its generation engine on the fake backend (tests/fake_backend.py): admission
under the staleness bound, requests paused or aborted across a weight update, lost requests
resubmitted after a restart. Seconds, no server, no torchrun, no process group."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from fake_backend import FakeBackend, make_ctx

from megatron_acrl.rollout.producer import AsyncProducer, make_producer
from megatron_acrl.run.resume import DriverState

ASYNC = ["rollout.mode=async", "rollout.max_staleness=1"]
B = 2  # prompts per step (fake_backend.make_ctx)


def wait_until(pred: Callable[[], bool], what: str, limit_s: float = 120.0) -> None:
    """Poll ``pred`` (a deadlock guard, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.005)


def start(backend: FakeBackend, *overrides: str) -> tuple[Any, AsyncProducer, DriverState]:
    ctx, state = make_ctx(backend, [*ASYNC, *overrides]), DriverState()
    producer = make_producer(ctx, state, None)
    assert isinstance(producer, AsyncProducer) and producer.engine is not None
    return ctx, producer, state


def idle(producer: AsyncProducer) -> Callable[[], bool]:
    """Nothing in flight and every admitted group finished."""
    engine = producer.engine
    assert engine is not None
    return lambda: (
        engine.stats()["async/in_flight_groups"] == 0 and not any(engine.servers.in_flight().values())
    )


def token_versions(batch: Any) -> set[int]:
    return set(batch.token_versions[batch.token_versions >= 0].unique().tolist())


def test_admission_stays_within_the_staleness_bound() -> None:
    backend = FakeBackend()
    _, producer, state = start(backend)
    engine = producer.engine
    assert engine is not None
    try:
        first, _ = producer.next_batch(state, 0)
        wait_until(idle(producer), "the engine settled")
        # K = 1: version 0 may sample the batches of steps 0 and 1, (K + 1) x B groups, no more
        assert engine.prompts.position == (1 + 1) * B
        producer.publish(1)
        second, _ = producer.next_batch(state, 1)
        wait_until(lambda: engine.prompts.position == (1 + 1) * B + B, "admission after the update")
        wait_until(idle(producer), "the engine settled")
        assert engine.prompts.position == 3 * B  # version 1 opens one more batch
        assert token_versions(first) == {0} and min(token_versions(second)) >= 1 - 1
        assert not set(first.group_ids.tolist()) & set(second.group_ids.tolist())
    finally:
        producer.close()


@pytest.mark.parametrize("mode", ["retract", "abort"])
def test_requests_in_flight_across_an_update(mode: str) -> None:
    """Retract: the requests paused half done continue on the new weights (two version segments).
    Abort: they end aborted and are generated again from scratch, never trained aborted."""
    backend = FakeBackend(pause_at_token=1, pause_mode=mode)  # every sample has >= 2 tokens
    partial = "true" if mode == "retract" else "false"  # abort cannot continue a partial rollout
    _, producer, state = start(backend, f"rollout.pause_mode={mode}", f"rollout.partial_rollouts={partial}")
    try:
        wait_until(backend.paused_midway.is_set, "a request half done")
        assert any(backend.in_flight().values())
        producer.publish(1)  # pauses, serves step-1, continues
        batches = [producer.next_batch(state, s)[0] for s in range(2)]
    finally:
        producer.close()
    assert all(b.token_versions is not None for b in batches)
    rows = [row[row >= 0].tolist() for b in batches for row in b.token_versions]  # type: ignore[union-attr]
    assert all(b.finish_reasons and "abort" not in b.finish_reasons for b in batches)
    spanning = [r for r in rows if set(r) == {0, 1}]
    if mode == "retract":
        assert spanning and all(r == sorted(r) for r in spanning)  # old tokens first, then new
    else:
        assert not spanning and backend.aborted > 0  # an aborted sample starts again on the new weights
        # and is sent again: more samples were asked for than the two batches hold
        assert sum(len(r) for r in backend.requests) >= sum(len(b) for b in batches) + backend.aborted


@pytest.mark.parametrize("fault", ["gone", "timeout"])
def test_lost_requests_are_resubmitted_after_a_restart(fault: str) -> None:
    backend = FakeBackend()
    backend.fail_next(fault)  # the first request fails (gone: with every other in flight)
    ctx, producer, state = start(backend)
    try:
        # K = 1: the (K + 1) x B groups admitted on version 0 are the batches of steps 0 and 1
        (first, metrics), (second, _) = (producer.next_batch(state, s) for s in range(2))
    finally:
        producer.close()
    assert backend.restarts == 1 and metrics["rollout/server_restarts"] == 1
    assert backend.updates == ["step-0", "step-0"]  # the restarted server got the served weights
    assert backend.requests[0] in backend.requests[1:]  # exactly those samples, sent again
    gids = first.group_ids.tolist() + second.group_ids.tolist()
    assert sorted(set(gids)) == list(range(2 * B)) and len(gids) == 2 * B * 2  # none lost, none twice
    assert set(first.finish_reasons + second.finish_reasons) == {"stop"}


def test_an_evaluation_holds_the_engine_with_nothing_in_flight() -> None:
    backend = FakeBackend(token_delay_s=0.001)
    ctx, producer, state = start(backend)
    seen: list[int] = []

    def evaluate(step: int) -> dict[str, float]:
        seen.append(sum(backend.in_flight().values()))
        return {"eval/x": 1.0}

    try:
        producer.next_batch(state, 0)
        producer._holding(evaluate, 0)
        assert seen == [0]
    finally:
        producer.close()
