"""Fan a rollout's groups out over several servers: one request per group, least-outstanding first.

    result = await fan_out(clients, prompts, params, n, max_in_flight=64)
    result.groups[i]          # the n samples of prompt i
    result.stats[k]           # what server k did: requests, samples, busy seconds, mean load

Each group (a prompt's ``n`` samples, cut into requests of at most ``samples_per_request``) is one
unit of work, sent with :meth:`SGLangClient.generate_group` so a server computes its prompt once.

Policies:

* ``least_outstanding`` (default): work is handed out late, one request at a time, to the server
  with the fewest requests in flight, never more than ``max_in_flight`` each. A server that finishes
  early takes the next group instead of idling while another works through a long tail, and a
  server that dies has its groups (the one in flight included) re-sent to the others: no group is
  lost while one server is left. A request that times out on a server that still answers its
  health check is sent again (``MAX_TIMEOUTS`` times at most): a slow batch is not a dead server.
  Each request's clock (the client's ``timeout_s``) starts when it is sent, never while it waits
  here for a free slot. Late binding is what balances: requests already queued inside a
  server cannot move, so ``max_in_flight`` should be about what a server runs at once.
* ``round_robin``: group i to server ``i % K`` up front (the classic static split); a dead server's
  groups still move to the others.

Through sglang-router there is one client (the router's URL) with ``max_in_flight`` of all servers
together, and the router picks the server; a request the router cannot place fails here.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sglang_bridge.samples import Sample, SamplingParams
from sglang_bridge.transport import RequestDropped, ServerGoneError, SGLangHTTPError

Policy = Literal["least_outstanding", "round_robin"]
POLICIES: tuple[str, ...] = ("least_outstanding", "round_robin")

_GONE = (ServerGoneError, RequestDropped, ConnectionError)


@dataclass
class ServerStats:
    """What one target did during a fan-out."""

    url: str
    requests: int = 0
    samples: int = 0
    tokens: int = 0
    """Generated tokens."""
    busy_s: float = 0.0
    """Wall time with at least one request in flight."""
    load_s: float = 0.0
    """Integral of the requests in flight over time (``load_s / seconds`` is the mean load)."""
    failed: str = ""
    """Why the target was given up (empty: it served to the end)."""


@dataclass
class FanOutResult:
    groups: list[list[Sample]]
    stats: list[ServerStats]
    seconds: float
    requeued: int = 0
    """Requests re-sent to another server after theirs failed (or timed out)."""
    timeouts: int = 0
    """Requests that timed out on a server that still answered, and were sent again."""


@dataclass
class _Target:
    client: Any
    stats: ServerStats
    in_flight: int = 0
    since: float = 0.0
    own: collections.deque = field(default_factory=collections.deque)  # round_robin's queue

    def mark(self, now: float, delta: int) -> None:
        """Account busy time and load up to ``now``, then change the requests in flight by ``delta``."""
        if self.in_flight:
            self.stats.busy_s += now - self.since
            self.stats.load_s += self.in_flight * (now - self.since)
        self.since = now
        self.in_flight += delta


def _work(num_prompts: int, n: int, per_request: int) -> list[tuple[int, int, int]]:
    """``(prompt, samples, request id)`` requests: each group cut into requests of at most
    ``per_request``."""
    out = []
    for i in range(num_prompts):
        left = n
        while left > 0:
            out.append((i, min(left, per_request), len(out)))
            left -= per_request
    return out


MAX_TIMEOUTS = 2
"""Times one request may time out on servers that still answer before the fan-out gives up."""


class _FanOut:
    def __init__(self, clients: Sequence[Any], policy: str, max_in_flight: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown fan-out policy {policy!r}; one of {POLICIES}")
        if not clients:
            raise ValueError("fan_out needs at least one client")
        self.targets = [_Target(c, ServerStats(getattr(c, "url", str(k)))) for k, c in enumerate(clients)]
        self.policy = policy
        self.cap = max_in_flight
        self.shared: collections.deque = collections.deque()
        self.cond = asyncio.Condition()
        self.busy = 0  # requests in flight over all targets
        self.requeued = 0
        self.timeouts: collections.Counter[int] = collections.Counter()  # request id -> timeouts

    def _queue(self, t: _Target) -> collections.deque:
        return t.own if self.policy == "round_robin" else self.shared

    def _pending(self) -> bool:
        return bool(self.shared) or any(t.own for t in self.targets)

    def _may_take(self, t: _Target) -> bool:
        """Whether ``t``'s idle slot takes the next request now: round-robin, whenever its own queue
        has one; least-outstanding, only if no serving target has fewer requests in flight (every
        target below ``max_in_flight`` has an idle slot waiting, so the least loaded one takes it).
        With no target left serving (the only one, or the router, failed) no slot takes anything:
        the workers return and :meth:`run` raises ``ServerGoneError`` naming each target."""
        if not self._queue(t):
            return False
        if self.policy == "round_robin":
            return True
        serving = [x.in_flight for x in self.targets if not x.stats.failed]
        return bool(serving) and t.in_flight <= min(serving)

    async def _timed_out(self, t: _Target, item: tuple[int, int, int], err: TimeoutError) -> bool:
        """A request timed out: a server that still answers (it was slow, or busy) gets it again,
        at the front, up to :data:`MAX_TIMEOUTS` times; one that does not is given up like a dead
        one. Returns whether ``t`` goes on serving."""
        health = getattr(t.client, "health", None)
        alive = bool(await health()) if health is not None else False
        async with self.cond:
            self.busy -= 1
            t.mark(time.monotonic(), -1)
            self.cond.notify_all()
            if not alive:
                t.stats.failed = f"TimeoutError (and no answer to a health check): {err}"
                self._give_back(t, item)
                return False
            self.timeouts[item[2]] += 1
            if self.timeouts[item[2]] > MAX_TIMEOUTS:
                raise TimeoutError(
                    f"a request of prompt {item[0]} timed out {self.timeouts[item[2]]} times on live servers "
                    f"(last {t.stats.url}: {err}); raise rollout.request_timeout_s, or lower "
                    "rollout.max_concurrency / samples_per_request so a request waits less behind others"
                ) from err
            self.requeued += 1
            self._queue(t).appendleft(item)
            return True

    def _give_back(self, t: _Target, item: tuple[int, int, int]) -> None:
        """A failed target's request (and, round-robin, its queue) to the targets still serving."""
        alive = [x for x in self.targets if not x.stats.failed]
        self.requeued += 1
        if self.policy != "round_robin" or not alive:
            self.shared.appendleft(item)
            return
        moved = [item, *t.own]
        t.own.clear()
        for j, it in enumerate(moved):
            alive[j % len(alive)].own.append(it)

    async def _worker(
        self, t: _Target, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], out: dict
    ) -> None:
        while True:
            async with self.cond:
                await self.cond.wait_for(lambda: self._may_take(t) or self.busy == 0 or bool(t.stats.failed))
                if t.stats.failed or not self._queue(t):
                    return
                item = self._queue(t).popleft()
                self.busy += 1
                t.mark(time.monotonic(), +1)
            try:
                samples = await t.client.generate_group(prompts[item[0]], params[item[0]], item[1])
            except TimeoutError as e:
                if await self._timed_out(t, item, e):
                    continue
                return
            except _GONE as e:
                async with self.cond:
                    t.stats.failed = f"{type(e).__name__}: {e}"
                    self._give_back(t, item)
                    self.busy -= 1
                    t.mark(time.monotonic(), -1)
                    self.cond.notify_all()
                return
            except BaseException:
                async with self.cond:
                    self.busy -= 1
                    t.mark(time.monotonic(), -1)
                    self.cond.notify_all()
                raise
            async with self.cond:
                out.setdefault(item[0], []).extend(samples)
                t.stats.requests += 1
                t.stats.samples += len(samples)
                t.stats.tokens += sum(len(s.output_ids) for s in samples)
                self.busy -= 1
                t.mark(time.monotonic(), -1)
                self.cond.notify_all()

    async def run(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], n: int, per_request: int
    ) -> FanOutResult:
        start = time.monotonic()
        work = _work(len(prompts), n, per_request)
        if self.policy == "round_robin":
            for j, item in enumerate(work):
                self.targets[j % len(self.targets)].own.append(item)
        else:
            self.shared.extend(work)
        for t in self.targets:
            t.since = start
        out: dict[int, list[Sample]] = {}
        # Slot-major order: with more slots than work, the first requests go one per target.
        workers = [
            asyncio.ensure_future(self._worker(t, prompts, params, out))
            for _ in range(self.cap)
            for t in self.targets
        ]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        if self._pending():
            why = "; ".join(f"{t.stats.url}: {t.stats.failed}" for t in self.targets)
            raise ServerGoneError(f"every rollout server failed with groups left ({why})")
        now = time.monotonic()
        for t in self.targets:
            t.mark(now, 0)
        groups = [out.get(i, []) for i in range(len(prompts))]
        timeouts = sum(self.timeouts.values())
        return FanOutResult(groups, [t.stats for t in self.targets], now - start, self.requeued, timeouts)


async def fan_out(
    clients: Sequence[Any],
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    n: int,
    *,
    policy: Policy = "least_outstanding",
    max_in_flight: int = 64,
    samples_per_request: int | None = None,
) -> FanOutResult:
    """``n`` samples of each of ``prompts`` over ``clients`` (:class:`SGLangClient` s, one per server
    or one for a router); see the module doc.

    Args:
        params: the sampling of every group, or one per prompt.
        max_in_flight: requests in flight per client at most.
        samples_per_request: a group of more samples is cut into several requests (None: one each).
    Returns:
        :class:`FanOutResult`; ``groups[i]`` holds prompt i's ``n`` samples.
    Raises:
        ServerGoneError: every client failed while groups were left.
        SGLangHTTPError: a server refused a request (not retried: the same request would fail again).
        TimeoutError: a request timed out more than :data:`MAX_TIMEOUTS` times on servers that still
            answered their health check (a timeout on one that does not is a dead server's).
    """
    if n < 1 or max_in_flight < 1:
        raise ValueError(f"n and max_in_flight must be >= 1, got n={n}, max_in_flight={max_in_flight}")
    per_request = samples_per_request or n
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling params")
    return await _FanOut(clients, policy, max_in_flight).run(prompts, per_prompt, n, per_request)


__all__ = ["POLICIES", "FanOutResult", "Policy", "SGLangHTTPError", "ServerStats", "fan_out"]
