"""A rollout whose server hangs, or whose router dies (issue #36 item 2): what rank 0 finds and
repairs (:meth:`ServerRecovery.recover_rollout`, over stand-in servers and a stand-in router), and
how the sync rollout phase and the async producer retry through the one retry vote, on the fake
backend (tests/fake_backend.py). Seconds, no server process; the real faults (a lone server
SIGSTOPped mid-rollout, the router SIGKILLed) are ``tests/test_rollout_hang.py`` (slow)."""

from __future__ import annotations

from typing import Any

import pytest
from fake_backend import FakeBackend, make_ctx
from test_server_recovery import Servers

import megatron_acrl.servers.recovery as recovery_mod
from megatron_acrl.rollout.phase import collect_rollouts
from megatron_acrl.rollout.producer import AsyncProducer, make_producer
from megatron_acrl.run.resume import DriverState
from sglang_bridge.client import ServerGoneError
from sglang_bridge.router import RouterError, RouterSpec
from sglang_bridge.transport import SGLangHTTPError


@pytest.fixture(autouse=True)
def _probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Health requests: a server answers unless it is stopped or deaf (no HTTP)."""

    def probe(url: str, key: str, timeout_s: float) -> tuple[bool, str, bool]:
        return True, "HTTP 200", False

    monkeypatch.setattr(recovery_mod, "probe", probe)


ROUTER_504 = SGLangHTTPError("http://router", "/generate", 504, "request to the worker timed out")
REFUSED = SGLangHTTPError("http://s0", "/generate", 400, "the prompt is too long")


class StandInRouter:
    """sglang-router's process, as :class:`ServerRecovery` uses it; ``started`` records every new
    one (its spec), ``busy_ports`` are ports another process took meanwhile."""

    started: list[RouterSpec] = []
    busy_ports: set[int] = set()

    def __init__(self, spec: RouterSpec, log_path: Any = "router.log", startup_timeout_s: float = 1.0):
        self.spec, self.log_path, self.startup_timeout_s = spec, log_path, startup_timeout_s
        self.port = spec.port or 40000 + len(self.started)
        self.up = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.up

    def start(self) -> StandInRouter:
        if self.spec.port in self.busy_ports:
            raise RouterError(f"sglang-router exited during start-up: address {self.spec.port} in use")
        StandInRouter.started.append(self.spec)
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        self.up = False

    def log_tail(self, n_lines: int = 40) -> str:
        return "(killed)"

    def remove_worker(self, url: str) -> None:
        pass


def _routed(monkeypatch: pytest.MonkeyPatch, states: list[str]) -> tuple[Servers, StandInRouter]:
    monkeypatch.setattr(recovery_mod, "SGLangRouter", StandInRouter)
    monkeypatch.setattr(StandInRouter, "started", [])
    monkeypatch.setattr(StandInRouter, "busy_ports", set())
    servers = Servers(states)
    router = StandInRouter(RouterSpec(worker_urls=tuple(servers.urls), port=31000))
    servers.router = router  # type: ignore[assignment]
    servers._routed = set(servers.urls)
    return servers, router


def test_a_stopped_server_behind_the_router_is_found_whatever_the_error_and_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router answers 504 for the worker that stopped (no process dead, no lost connection):
    before, that was fatal; now the stopped server is found, killed and replaced."""
    servers, _ = _routed(monkeypatch, ["stopped"])
    done = servers.recover_rollout(ROUTER_504)
    assert done is not None and "hung" in done and "processes [100] are stopped" in done
    assert servers.log[0] == ("stop", 0, "stopped") and ("start", 0) in servers.log  # killed as it was
    assert servers.hung_restarts == 1 and servers.restarts == 1 and servers.router_restarts == 0


def test_a_lone_server_that_stopped_answering_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    servers = Servers(["deaf"])

    def probe(url: str, key: str, timeout_s: float) -> tuple[bool, str, bool]:
        return False, "not reachable (timed out)", False

    monkeypatch.setattr(recovery_mod, "probe", probe)
    done = servers.recover_rollout(TimeoutError("the server finished no request for 20 s"))
    assert done is not None and "no answer to a health request" in done
    assert servers.hung_restarts == 1 and servers.servers[0].state == "up"


def test_a_dead_router_is_started_again_on_its_port_with_the_same_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servers, old = _routed(monkeypatch, ["up", "up"])
    old.up = False  # SIGKILLed
    done = servers.recover_rollout(ServerGoneError("http://127.0.0.1:31000 unreachable"))
    assert done is not None and "sglang-router exited; restarted on http://127.0.0.1:31000" in done
    assert [s.port for s in StandInRouter.started] == [31000]
    assert StandInRouter.started[0].worker_urls == tuple(servers.urls)
    assert servers.router is not old and servers.router_restarts == 1 and servers.restarts == 1
    assert not [e for e in servers.log if e[0] in ("stop", "start")]  # the servers are kept


def test_a_dead_router_whose_port_was_taken_gets_a_free_one(monkeypatch: pytest.MonkeyPatch) -> None:
    servers, old = _routed(monkeypatch, ["up"])
    old.up = False
    StandInRouter.busy_ports.add(31000)
    assert servers.recover_rollout(ServerGoneError("gone")) is not None
    assert [s.port for s in StandInRouter.started] == [None]  # a free one
    assert servers.router is not None and servers.router.alive()


def test_a_refused_request_with_every_server_well_is_not_repaired() -> None:
    servers = Servers(["up", "up"])
    assert servers.recover_rollout(REFUSED) is None
    assert servers.log == [] and servers.restarts == 0


# -- the rollout phase and the async producer ------------------------------------------------------


def test_sync_a_hung_server_is_replaced_and_the_step_retried_with_the_same_prompts() -> None:
    backend = FakeBackend()
    backend.fail_next("hang")
    ctx, state = make_ctx(backend), DriverState()
    restores: list[int] = []
    batch, metrics = collect_rollouts(ctx, state, 0, restore=lambda: restores.append(backend.restarts))
    assert restores == [1] and backend.hung_restarts == 1 and not backend.hung
    assert len(backend.requests) == 2 and backend.requests[0] == backend.requests[1]
    assert state.prompts_consumed == 2 and len(batch) == 4
    assert metrics["rollout/hung_restarts"] == 1 and metrics["rollout/server_restarts"] == 1
    assert metrics["rollout/router_restarts"] == 0


def test_sync_a_refused_request_is_fatal_on_the_first_try() -> None:
    backend = FakeBackend()
    backend.fail_next("refused")
    ctx, state = make_ctx(backend), DriverState()
    with pytest.raises(RuntimeError, match=r"rollout of step 1 failed: SGLangHTTPError: .*HTTP 400"):
        collect_rollouts(ctx, state, 0, restore=lambda: pytest.fail("nothing to repair"))
    assert backend.restarts == 0 and len(backend.requests) == 1


def _async(backend: FakeBackend) -> tuple[AsyncProducer, DriverState]:
    ctx, state = make_ctx(backend, ["rollout.mode=async", "rollout.max_staleness=1"]), DriverState()
    producer = make_producer(ctx, state, None)
    assert isinstance(producer, AsyncProducer)
    return producer, state


def test_async_a_hung_server_is_replaced_and_its_requests_resubmitted() -> None:
    backend = FakeBackend()
    backend.fail_next("hang")
    producer, state = _async(backend)
    try:
        (first, metrics), (second, _) = (producer.next_batch(state, s) for s in range(2))
    finally:
        producer.close()
    assert backend.hung_restarts == 1 and metrics["rollout/hung_restarts"] == 1
    assert backend.updates == ["step-0", "step-0"]  # the fresh server got the served weights
    gids = first.group_ids.tolist() + second.group_ids.tolist()
    assert sorted(set(gids)) == list(range(4)) and len(gids) == 8  # none lost, none twice


def test_async_a_refused_request_is_fatal() -> None:
    backend = FakeBackend()
    backend.fail_next("refused")
    producer, state = _async(backend)
    try:
        with pytest.raises(RuntimeError, match=r"rollout of step 1 failed: SGLangHTTPError"):
            producer.next_batch(state, 0)
    finally:
        producer.close()
    assert backend.restarts == 0
