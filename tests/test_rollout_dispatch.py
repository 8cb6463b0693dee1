"""The servers' one dispatch path (megatron_acrl/servers/dispatch.py) with stand-in clients: both ways
of generating pick their targets, clients and in-flight count in one place, an async request goes
through the router when there is one, and a fan-out whose only target fails names it (issue #36).
No server; the same through a real sglang-router is in tests/bridge/test_routing.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from megatron_acrl.config import load_config
from megatron_acrl.rollout.backend import RolloutBackend
from megatron_acrl.servers.dispatch import Dispatch, LoadTally
from megatron_acrl.servers.handle import RolloutServers
from sglang_bridge.fanout import fan_out
from sglang_bridge.samples import Sample, SamplingParams
from sglang_bridge.transport import ServerGoneError

PARAMS = SamplingParams(max_new_tokens=2)


class StandIn:
    """A client of ``url``: answers every sample with two tokens and records what it was sent."""

    sent: list[tuple[str, int]] = []

    def __init__(self, url: str, cap: int, fail: BaseException | None = None, healthy: bool = True):
        self.url, self.cap, self.fail, self.healthy = url, cap, fail, healthy

    def _sample(self, prompt: Sequence[int]) -> Sample:
        return Sample(list(prompt), [5, 1], [-0.1, -0.2], "stop", "step-0", server=self.url)

    async def generate_batch(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[Sample]:
        StandIn.sent.append((self.url, len(prompts)))
        await asyncio.sleep(0)
        return [self._sample(p) for p in prompts]

    async def generate_group(self, prompt: Sequence[int], params: SamplingParams, n: int) -> list[Sample]:
        StandIn.sent.append((self.url, n))
        await asyncio.sleep(0.001)
        if self.fail is not None:
            raise self.fail
        return [self._sample(prompt) for _ in range(n)]

    async def health(self) -> bool:
        return self.healthy

    async def aclose(self) -> None:
        pass


class Proc:
    """A stand-in server (or router) process."""

    def __init__(self, url: str, alive: bool = True):
        self.url, self._alive, self.log_path = url, alive, Path("router.log")

    def alive(self) -> bool:
        return self._alive


def servers(router: bool = False, dead: Sequence[int] = ()) -> RolloutServers:
    """A :class:`RolloutServers` over two stand-in servers (and a stand-in router), nothing started."""
    h = RolloutServers.__new__(RolloutServers)
    h.cfg = load_config(None, ["rollout.max_concurrency=3", *(["rollout.router=sglang"] if router else [])])
    h.servers = [Proc(f"http://s{i}", alive=i not in dead) for i in range(2)]  # type: ignore[misc]
    h.urls = [s.url for s in h.servers]
    h.router = Proc("http://router") if router else None  # type: ignore[assignment]
    h._routed = set(h.urls) if router else set()
    h._load = LoadTally({u: k for k, u in enumerate(h.urls)})
    h.dispatch = Dispatch(lambda url, cap: StandIn(url, cap))
    StandIn.sent = []
    return h


def send(
    h: RolloutServers, batches: list[list[list[int]]]
) -> tuple[list[list[Sample]], list[dict[str, int]]]:
    """Send each batch at once (the async engine's way), then await them all; the in-flight counts
    seen right after each send."""

    async def go() -> tuple[list[list[Sample]], list[dict[str, int]]]:
        futures, counts = [], []
        for b in batches:
            futures.append(h.generate_async(b, PARAMS))
            counts.append(h.in_flight())
        try:
            return list(await asyncio.gather(*futures)), counts
        finally:
            await h.aclose()

    return asyncio.run(go())


def test_the_servers_handle_is_a_rollout_backend() -> None:
    backend: RolloutBackend = servers()  # what mypy checks; and at run time, every method:
    missing = [m for m in RolloutBackend.__dict__ if not m.startswith("_") and not hasattr(backend, m)]
    assert missing == []


def test_async_requests_go_to_the_least_loaded_live_server_counted_at_once() -> None:
    h = servers()
    out, counts = send(h, [[[1, 2]] * 3, [[3, 4]] * 2, [[5]]])
    assert counts == [
        {"http://s0": 3, "http://s1": 0},
        {"http://s0": 3, "http://s1": 2},
        {"http://s0": 3, "http://s1": 3},
    ]
    assert [s.server for s in out[0]] == ["http://s0"] * 3 and {s.server for s in out[2]} == {"http://s1"}
    assert h.in_flight() == {"http://s0": 0, "http://s1": 0}  # uncounted when they end
    h = servers(dead=[0])
    assert {s.server for b in send(h, [[[1]], [[2]]])[0] for s in b} == {"http://s1"}  # never to a dead one


def test_with_the_router_every_request_goes_through_it() -> None:
    h = servers(router=True)
    out, counts = send(h, [[[1, 2]] * 2, [[3]]])
    assert {s.server for b in out for s in b} == {"http://router"}
    assert counts[-1] == {"http://router": 3}
    # one request per prompt (sglang-router refuses a batch of prompts), a group's samples with n
    assert StandIn.sent == [("http://router", 2), ("http://router", 1)]
    assert h._cap() == 2 * 3  # the router holds every routed server's share


def test_an_async_request_to_a_dead_router_fails_as_a_server_gone() -> None:
    h = servers(router=True)
    assert h.router is not None
    h.router._alive = False  # type: ignore[attr-defined]
    with pytest.raises(ServerGoneError, match="sglang-router exited"):
        send(h, [[[1]]])


def test_blocking_generation_takes_the_same_path_and_counts() -> None:
    h = servers(dead=[1])
    groups = h.generate([[1, 2], [3, 4], [5, 6]], 2, PARAMS)
    assert [len(g) for g in groups] == [2, 2, 2]
    assert {s.server for g in groups for s in g} == {"http://s0"}
    assert {u for u, _ in StandIn.sent} == {"http://s0"}
    assert h.in_flight() == {"http://s0": 0, "http://s1": 0}
    assert h.load_metrics()["rollout/server_samples/0"] == 6


@pytest.mark.parametrize(
    "fail, healthy",
    [(ServerGoneError("http://only is gone"), True), (TimeoutError("no answer"), False)],
    ids=["gone", "stops-answering"],
)
def test_a_fan_out_whose_only_target_fails_names_it(fail: BaseException, healthy: bool) -> None:
    """Issue #36: with one server (the default) or one router, a target that fails while other slots
    wait used to end in ``min() arg is an empty sequence``."""
    only = StandIn("http://only", 3, fail=fail, healthy=healthy)

    async def go() -> Any:
        return await fan_out([only], [[1, 2], [3, 4]], PARAMS, 2, max_in_flight=3)

    with pytest.raises(
        ServerGoneError, match=r"every rollout server failed with groups left \(http://only: "
    ):
        asyncio.run(go())
