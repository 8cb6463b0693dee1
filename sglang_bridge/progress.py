"""The clock a ``/generate`` request is timed by: its server's progress, not its own age.

A request sent to a busy server waits in the server's queue before the server starts on it, and a
non-streaming ``/generate`` says nothing until it is done, so a timeout on each request's age counts
that wait: with ``timeout_s=60``, a 256 x 8 rollout from a healthy server returned 0 of 2048 samples
(issue #25). :class:`ServerProgress` times a request from ``max(when it was sent, when its server
last finished a request)`` instead: it times out only when the server has finished *none* of this
client's ``/generate`` requests for ``timeout_s`` while it was in flight. A healthy server whose
every request takes less than ``timeout_s`` to serve finishes one at least every ``timeout_s`` (the
oldest request it is serving started at most ``timeout_s`` ago), so however long its queue, none of
its requests times out; a hung or dead one still fails within ``timeout_s``.

Why not the alternatives (measured on one CPU server, a tiny model, 64 groups of 8 samples of 32
tokens, docs/bridge.md "Rollout timeouts"): streaming ``/generate``, whose first chunk marks that the
server started, took 15.0 s against 7.8 s without streaming (a chunk per token to encode, send and
decode), and bounding the requests in flight to what the server runs at once, so that none waits
in its queue, took 12.9 s (16 groups in flight) to 16.9 s (4) against 7.8 s (64): the server's
scheduler fills its batch better from its own queue than from a client's late sends. This clock
costs nothing: no extra request, no chunk, the same concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

_T = TypeVar("_T")


class ServerProgress:
    """When the server last finished one of its client's timed requests, and a wait that times a
    request by it (module doc). One per client (server URL); used on the client's event loop only."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.clock = clock
        self.last = float("-inf")
        """``clock()`` when the server last answered a timed request (any status)."""

    def deadline(self, sent: float) -> float:
        """When a request sent at ``sent`` times out unless the server finishes something first."""
        return max(sent, self.last) + self.timeout_s

    async def wait(self, request: Awaitable[_T]) -> _T:
        """Await ``request``; raise :class:`TimeoutError` (and cancel it) once its server has
        finished nothing for :attr:`timeout_s` while it ran. An answer is progress; a request that
        fails (a dropped connection) is not."""
        task = asyncio.ensure_future(request)
        sent = self.clock()
        try:
            while True:
                left = self.deadline(sent) - self.clock()
                if left <= 0:
                    raise TimeoutError(
                        f"the server finished no request for {self.timeout_s:g} s while this one waited"
                    )
                done, _ = await asyncio.wait({task}, timeout=left)
                if done:
                    result = task.result()
                    self.last = max(self.last, self.clock())
                    return result
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
