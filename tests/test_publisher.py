"""The fault protocol written once (:func:`megatron_acrl.world.vote.vote`) and the weight publisher
that uses it (:class:`megatron_acrl.servers.publisher.WeightPublisher`): every verdict, the retries
with their recovery, the stop rule and the lag buffer, in one process on stand-in servers (the real
servers' faults are tests/test_hung_server.py and tests/test_e2e.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatron_acrl.config import load_config
from megatron_acrl.servers.publisher import PUSH_ATTEMPTS, WeightPublisher
from megatron_acrl.servers.transfer import HUNG, RESTART
from megatron_acrl.world.vote import ERROR, OK, RETRY, STOPPED, StoppedWithoutServers, vote
from sglang_bridge.client import ServerGoneError
from sglang_bridge.weight_sync import ManifestMismatchError, WeightSyncTimeoutError


def _vote(verdicts: list[tuple[str, Any]], attempts: int = 3) -> tuple[Any, list]:
    log: list = []

    def once(attempt: int) -> tuple[str, Any]:
        log.append(("try", attempt))
        return verdicts[attempt]

    value = vote(
        once,
        attempts=attempts,
        recover=lambda attempt, why: log.append(("recover", attempt, why)),
        failed=lambda why, exhausted: f"failed {why} exhausted={exhausted}",
        stopped=lambda why: f"stopped {why}",
    )
    return value, log


def test_ok_returns_the_value_at_once() -> None:
    assert _vote([(OK, 7)]) == (7, [("try", 0)])


def test_a_retry_recovers_then_tries_again() -> None:
    value, log = _vote([(RETRY, "gone"), (RETRY, "again"), (OK, "batch")])
    assert value == "batch"
    assert log == [("try", 0), ("recover", 0, "gone"), ("try", 1), ("recover", 1, "again"), ("try", 2)]


def test_the_last_retry_fails_without_a_futile_recovery() -> None:
    log: list = []
    with pytest.raises(RuntimeError, match="failed third exhausted=True"):
        vote(
            lambda a: (RETRY, ["first", "second", "third"][a]),
            attempts=3,
            recover=lambda a, why: log.append(a),
            failed=lambda why, exhausted: f"failed {why} exhausted={exhausted}",
            stopped=str,
        )
    assert log == [0, 1]


def test_an_error_is_raised_at_once() -> None:
    with pytest.raises(RuntimeError, match="failed bad input exhausted=False"):
        _vote([(ERROR, "bad input"), (OK, 1)])


def test_a_stop_raises_stopped_without_servers() -> None:
    with pytest.raises(StoppedWithoutServers, match="stopped server gone"):
        _vote([(STOPPED, "server gone"), (OK, 1)])


def test_a_rank_without_a_verdict_is_an_error_not_a_hang() -> None:
    with pytest.raises(RuntimeError, match="no verdict"):
        _vote([("", None)])


class Servers:
    """Rank 0's handle as the publisher sees it: ``update_weights`` raises the queued errors first,
    then records what it was sent."""

    def __init__(self, errors: list[BaseException] | None = None, dead: list[int] | None = None) -> None:
        self.errors = list(errors or [])
        self.dead = list(dead or [])
        self.pushed: list[tuple[str, list[str], bool]] = []
        self.recovered: list[tuple[str, int]] = []
        self.restarts = self.hung_restarts = 0

    def dead_servers(self) -> list[int]:
        return self.dead

    def update_weights(self, stream: Any, version: str, *, quantize: bool, meta: Any) -> dict[str, float]:
        if self.errors:
            raise self.errors.pop(0)
        self.pushed.append((version, [n for n, _ in stream], quantize))
        return {"sync/seconds": 0.1}

    def recover(self, action: str, attempt: int) -> None:
        self.recovered.append((action, attempt))
        self.dead = []
        self.restarts += 1


class Policy:
    """HF-named weights whose value is the policy's version (``step``), walked lazily."""

    def __init__(self) -> None:
        self.step = 0
        self.walks = 0

    def hf_weights(self, all_stages: bool = True) -> Any:
        self.walks += 1
        yield "w", torch.full((2,), float(self.step))


def _publisher(servers: Servers, lag: int = 0, stopping: bool = False) -> WeightPublisher:
    cfg = load_config(None, [f"rollout.weight_lag_steps={lag}", "rollout.weight_sync=rank0"])
    return WeightPublisher(cfg, 0, Policy(), servers, stopping=lambda: stopping)


def test_a_dead_server_is_restarted_and_the_push_retried() -> None:
    servers = Servers([ServerGoneError("gone")], dead=[0])
    m = _publisher(servers).push("step-1")
    assert servers.recovered == [(RESTART, 0)] and servers.pushed == [("step-1", ["w"], True)]
    assert m["sync/restarts"] == 1.0 and m["sync/hung_restarts"] == 0.0


def test_a_hung_server_is_replaced_and_a_repeat_escalates() -> None:
    servers = Servers([WeightSyncTimeoutError("slow"), WeightSyncTimeoutError("slow again")])
    _publisher(servers).push("step-1")
    assert servers.recovered == [(HUNG, 0), (HUNG, 1)]  # the attempt lets recover() escalate


def test_bad_input_is_not_retried() -> None:
    servers = Servers([ManifestMismatchError("wrong shape")])
    with pytest.raises(
        RuntimeError, match="weight sync to step-1 failed: ManifestMismatchError: wrong shape"
    ):
        _publisher(servers).push("step-1")
    assert servers.recovered == []


def test_three_failures_end_the_run_naming_the_logs() -> None:
    servers = Servers([ServerGoneError("gone")] * PUSH_ATTEMPTS)
    with pytest.raises(RuntimeError, match=f"failed {PUSH_ATTEMPTS} times"):
        _publisher(servers).push("step-1")
    assert len(servers.recovered) == PUSH_ATTEMPTS - 1


def test_a_publish_that_fails_after_a_stop_ends_the_step_without_servers() -> None:
    servers = Servers([ServerGoneError("gone")], dead=[0])
    pub = _publisher(servers, stopping=True)
    assert pub.publish(1) == {"sync/stopped": 1.0}
    assert pub.servers_gone and pub.version == 1 and servers.recovered == []  # nothing restarted


def test_outside_the_loop_a_stop_does_not_block_recovery() -> None:
    servers = Servers([ServerGoneError("gone")], dead=[0])
    _publisher(servers, stopping=True).push("eval")  # not stoppable: start-up, evaluation
    assert servers.recovered == [(RESTART, 0)]


def test_the_lag_buffer_serves_the_version_lag_steps_behind() -> None:
    servers = Servers()
    pub = _publisher(servers, lag=2)
    policy = pub.policy
    pub.start(0)
    for v in range(1, 5):
        policy.step = v
        pub.publish(v)
        assert pub.version == max(0, v - 2) and min(pub.sets) == pub.version and max(pub.sets) == v
    # pushed: version 0 at start, then 0 again never (unchanged at v = 1, 2), then 1 and 2
    assert [p[0] for p in servers.pushed] == ["step-0", "step-1", "step-2"]
    assert pub.held_bytes == 3 * 2 * 4
    pub.close()
    assert pub.sets == {}
