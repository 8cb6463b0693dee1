"""Agent trajectories in ``rollout.mode: async`` on the fake backend: the engine runs them, a weight
update between or inside turns is recorded per token, the staleness bound holds per generated token
(a trajectory too stale is generated again, counted), aborted turns are sent again, lost ones are
regenerated after a restart, an evaluation holds every turn, and a resume regenerates the admitted,
untrained groups. Seconds, no server, no torchrun."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from megatron_acrl.config import load_config
from megatron_acrl.rollout.producer import AsyncProducer, make_producer
from megatron_acrl.run.context import prompt_stream
from megatron_acrl.run.resume import DriverState
from tests.agent.async_agents import HeldTurns, digit_answer
from tests.fake_backend import FakeBackend, calculator_answer, make_ctx

B, N = 2, 2  # prompts per step, trajectories per prompt (fake_backend.make_ctx)
AGENT = [
    "rollout.mode=async",
    "rollout.max_staleness=1",
    "rollout.agent.agent=tests.agent.async_agents:three_turns",
    "rollout.max_new_tokens=128",
    "rollout.max_prompt_len=256",
]


def wait_until(pred: Callable[[], bool], what: str, limit_s: float = 120.0) -> None:
    """Poll ``pred`` (a deadlock guard, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.005)


def start(
    backend: Any, *overrides: str, state: DriverState | None = None
) -> tuple[Any, AsyncProducer, DriverState]:
    ctx, state = make_ctx(backend, [*AGENT, *overrides]), state or DriverState()
    producer = make_producer(ctx, state, None)
    assert isinstance(producer, AsyncProducer) and producer.engine is not None
    return ctx, producer, state


def questions(overrides: list[str], count: int) -> list[str]:
    """The first ``count`` prompts the run admits (its group ids 0..count-1), as the run draws them."""
    cfg = load_config(None, ["task.num_digits=1", "task.heldout_fraction=0", *overrides])
    from megatron_acrl.tasks import make_task

    stream = prompt_stream(make_task(cfg.task), cfg.training.seed)
    return [next(stream).text for _ in range(count)]


def held_questions(after: list[int]) -> dict[str, int]:
    """Hold the second turn of groups 2 and 3 (step 1's) after ``after[i]`` tokens; their questions
    must differ from those of steps 0's groups, or step 0 would be held too."""
    q = questions([], 4)
    assert not set(q[2:]) & set(q[:2]), f"the seed's first prompts repeat ({q}): pick other groups"
    return {q[2]: after[0], q[3]: after[1]}


def rows_of(batch: Any) -> list[dict[str, Any]]:
    """Per row: the versions of its generated tokens by turn, and its alignment checks."""
    out = []
    for i in range(len(batch)):
        gen = batch.loss_mask[i] > 0
        assert ((batch.turn_ids[i] >= 0) == gen).all() and ((batch.token_versions[i] >= 0) == gen).all()
        assert (batch.rollout_logprobs[i][~gen] == 0).all()
        turns = batch.turn_ids[i][gen]
        versions = batch.token_versions[i][gen]
        out.append({t: versions[turns == t].tolist() for t in sorted(set(turns.tolist()))})
    return out


def test_async_agent_batches_hold_multi_turn_rows_with_their_metrics() -> None:
    backend = FakeBackend(calculator_answer, max_new_tokens=128)
    _, producer, state = start(backend, "rollout.agent.agent=null", "rollout.agent.env=calculator")
    try:
        (b0, m0), (b1, _) = (producer.next_batch(state, s) for s in range(2))
    finally:
        producer.close()
    for b in (b0, b1):
        assert len(b) == B * N and b.finish_reasons == ["answered"] * (B * N)
        assert set(b.rewards.tolist()) <= {0.0, 1.0}  # odd requests answer the result + 1
        assert all(list(r) == [0, 1] and uniform(r, 0) for r in rows_of(b))  # two turns, version 0
    assert sorted(set(b0.group_ids.tolist()) | set(b1.group_ids.tolist())) == list(range(2 * B))
    assert m0["agent/turns_mean"] == 2.0 and m0["agent/tool_calls"] == B * N
    assert m0["async/regenerated_trajectories"] == 0.0
    keys = backend.affinities
    assert None not in keys and all(keys.count(k) == 2 for k in set(keys))  # one key per trajectory


def uniform(row: dict[int, list[int]], version: int, turns: tuple[int, ...] | None = None) -> bool:
    """Every generated token of ``turns`` (default: all) of ``row`` has ``version``."""
    return all(set(row[t]) == {version} for t in (turns if turns is not None else row))


def test_a_weight_update_between_and_inside_turns_is_recorded_per_token() -> None:
    """Group 2's second turn waits for the update before its first token (between turns), group 3's
    after its first two tokens (inside the turn): both trajectories span versions 0 and 1, exactly."""
    backend = HeldTurns(held_questions([0, 2]), answer=digit_answer, max_new_tokens=128)
    _, producer, state = start(backend)
    try:
        first, _ = producer.next_batch(state, 0)
        wait_until(lambda: backend.waiting == 2 * N, "the held turns in flight, waiting for the update")
        producer.publish(1)
        second, _ = producer.next_batch(state, 1)
    finally:
        producer.close()
    assert all(list(r) == [0, 1, 2] and uniform(r, 0) for r in rows_of(first))
    rows = list(zip(second.group_ids.tolist(), rows_of(second), strict=True))
    assert sorted(g for g, _ in rows) == [2] * N + [3] * N
    for g, r in rows:
        assert uniform(r, 0, (0,)) and uniform(r, 1, (2,))
        if g == 2:  # the update came between turns 0 and 1
            assert uniform(r, 1, (1,))
        else:  # inside turn 1, after its first two tokens
            assert r[1][:2] == [0, 0] and set(r[1][2:]) == {1}
    lag = 1 - second.token_versions[second.loss_mask > 0]
    assert int(lag.max()) <= 1 and int(lag.min()) >= 0  # the bound holds per generated token


def test_a_trajectory_too_stale_to_train_is_generated_again_and_counted() -> None:
    """stale_policy drop, K = 1: groups 2 and 3 hold their second turn until version 2, so their
    third turn would start with tokens of version 0 at step 2: stopped there, generated again from
    scratch on version 2, and trained at step 2 (the earliest deadline of the ready groups).

    Under ``drop`` a step never waits for a group in flight: the regenerated trajectories race the
    groups admitted after them (6 and 7, then 8 and 9), and a step that took those first would leave
    2 and 3 to be dropped two steps after their regeneration. The test lets the regenerated groups
    finish before it asks for step 2 (a state it waits for, not a time), so the outcome is fixed."""
    backend = HeldTurns(held_questions([0, 0]), until=2, answer=digit_answer, max_new_tokens=128)
    _, producer, state = start(backend, "rollout.stale_policy=drop")
    engine = producer.engine
    assert engine is not None

    def finished(gids: set[int]) -> bool:
        with engine.cond:
            return gids <= {g.gid for g in engine.queue.ready()}

    try:
        first, _ = producer.next_batch(state, 0)
        producer.publish(1)
        second, _ = producer.next_batch(state, 1)
        wait_until(lambda: backend.waiting == 2 * N, "groups 2 and 3 held in their second turn")
        producer.publish(2)
        wait_until(lambda: finished({2, 3}), "groups 2 and 3 generated again and finished")
        third, metrics = producer.next_batch(state, 2)
    finally:
        producer.close()
    gids = [sorted(set(b.group_ids.tolist())) for b in (first, second, third)]
    assert gids == [[0, 1], [4, 5], [2, 3]], gids
    assert metrics["async/regenerated_trajectories"] == 2 * N  # every trajectory of groups 2 and 3
    assert metrics["async/dropped_stale_groups"] == 0  # regenerated in time, nothing finished was dropped
    assert "stale" not in third.finish_reasons
    # generated again from scratch: all three turns on version 2, trained at step 2 (lag 0)
    assert all(list(r) == [0, 1, 2] and uniform(r, 2) for r in rows_of(third))
    assert_unpinned(backend)


def assert_unpinned(backend: FakeBackend) -> None:
    """Every trajectory's affinity key was unpinned once, when it ended (trained, stopped as stale,
    lost with its server, or cancelled when the producer closed): no pin outlives its trajectory."""
    keys = {k for k in backend.affinities if k is not None}
    assert keys and sorted(backend.unpinned) == sorted(keys), (keys, backend.unpinned)


def test_aborted_turns_are_sent_again_and_never_trained() -> None:
    """pause_mode abort: the held turn in flight at the update ends aborted; its session sends it
    again from the same ids, and only the new turn's tokens (version 1) are trained."""
    backend = HeldTurns(held_questions([1, 1]), pause_mode="abort", answer=digit_answer, max_new_tokens=128)
    _, producer, state = start(backend, "rollout.pause_mode=abort", "rollout.partial_rollouts=false")
    try:
        producer.next_batch(state, 0)
        wait_until(lambda: backend.waiting == 2 * N, "the held turns in flight")
        producer.publish(1)
        second, metrics = producer.next_batch(state, 1)
    finally:
        producer.close()
    assert backend.aborted == 2 * N and metrics["agent/aborted_turns"] == 2 * N
    assert all(uniform(r, 0, (0,)) and uniform(r, 1, (1, 2)) for r in rows_of(second))
    assert set(second.finish_reasons) == {"answered"}


def test_a_trajectory_lost_with_its_server_is_generated_again_after_the_restart() -> None:
    backend = FakeBackend(digit_answer, max_new_tokens=128)
    backend.fail_next("gone")  # the first turn sent fails, with every other in flight
    _, producer, state = start(backend)
    try:
        (first, metrics), (second, _) = (producer.next_batch(state, s) for s in range(2))
    finally:
        producer.close()
    assert backend.restarts == 1 and metrics["rollout/server_restarts"] == 1
    gids = first.group_ids.tolist() + second.group_ids.tolist()
    assert sorted(set(gids)) == list(range(2 * B)) and len(gids) == 2 * B * N  # none lost, none twice
    assert_unpinned(backend)  # the lost attempts' keys too (their retries have new ones)
    assert all(list(r) == [0, 1, 2] and uniform(r, 0) for b in (first, second) for r in rows_of(b))


def test_an_evaluation_holds_every_turn() -> None:
    """While the engine holds, no turn of any trajectory is sent (a trajectory between turns waits),
    so the evaluation's pushes never reach a training sample."""
    release = threading.Event()
    backend = HeldTurns(held_questions([1, 1]), release=release, answer=digit_answer, max_new_tokens=128)
    _, producer, state = start(backend)
    engine = producer.engine
    assert engine is not None
    sent_while_held: list[int] = []

    def evaluate(step: int) -> dict[str, float]:
        before = len(backend.requests)
        assert sum(backend.in_flight().values()) == 0
        backend.update_weights([], "step-0+unquantized")  # what an evaluation pushes
        time.sleep(0.3)  # the held trajectories' next turns would go now (no timing is asserted)
        sent_while_held.append(len(backend.requests) - before)
        backend.update_weights([], "step-0")
        return {}

    try:
        producer.next_batch(state, 0)
        wait_until(lambda: backend.waiting == 2 * N, "the held turns in flight")
        holding = threading.Thread(target=producer._holding, args=(evaluate, 0))
        holding.start()
        wait_until(lambda: engine.held > 0, "the hold began")
        release.set()  # the held turns finish; the trajectories' next turns must wait
        holding.join()
        second, _ = producer.next_batch(state, 1)
    finally:
        producer.close()
    assert sent_while_held == [0]
    assert all(uniform(r, 0) and list(r) == [0, 1, 2] for r in rows_of(second))  # none unquantized


def test_resume_regenerates_the_admitted_untrained_groups_with_their_ids() -> None:
    backend = FakeBackend(digit_answer, max_new_tokens=128)
    _, producer, state = start(backend)
    try:
        first, _ = producer.next_batch(state, 0)
        state.step = 1
        producer.checkpoint_into(state)  # what a SIGTERM's checkpoint holds
    finally:
        producer.close()
    pending = [g for g, *_ in state.producer["pending"]]  # type: ignore[index]
    assert pending == [2, 3] and state.prompts_consumed == 2 * B
    resumed = FakeBackend(digit_answer, max_new_tokens=128)
    _, producer, _ = start(resumed, state=state)
    try:
        second, _ = producer.next_batch(state, 1)
    finally:
        producer.close()
    assert sorted(set(second.group_ids.tolist())) == pending  # regenerated first, with their ids
    assert not set(first.group_ids.tolist()) & set(pending)


@pytest.mark.parametrize("policy", ["wait", "drop"])
def test_async_mode_with_an_agent_loads(policy: str) -> None:
    cfg = load_config(
        None, ["rollout.mode=async", "rollout.agent.env=calculator", f"rollout.stale_policy={policy}"]
    )
    assert cfg.rollout.mode == "async" and cfg.rollout.agent.env == "calculator"
