"""A synchronizer's HTTP calls to its servers (any transport): one :class:`SGLangClient` per server,
run on a private event-loop thread, so that blocking callers (a driver loop) can make them while
other event loops run in their own thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

from sglang_bridge.client import SGLangClient


class ServerCalls:
    """The clients of ``urls`` on their own event-loop thread; :meth:`close` stops it (idempotent)."""

    def __init__(self, urls: Sequence[str], *, api_key: str | None, timeout_s: float):
        self.urls = list(urls)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weight-sync-http", daemon=True)
        self._thread.start()

        async def make_clients() -> list[SGLangClient]:  # on the loop: the clients belong to it
            return [SGLangClient(u, api_key=api_key, timeout_s=timeout_s, max_concurrency=16) for u in urls]

        self.clients: list[SGLangClient] = self.run(make_clients())

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Start ``coro`` on the loop; its future can be waited on from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the loop and wait for its result."""
        return self.submit(coro).result()

    def submit_all(self, method: str, *args: Any, **kw: Any) -> concurrent.futures.Future[list[Any]]:
        """``method`` on every server at once; the future holds their answers in server order."""

        async def go() -> list[Any]:
            return list(await asyncio.gather(*(getattr(c, method)(*args, **kw) for c in self.clients)))

        return self.submit(go())

    def all(self, method: str, *args: Any, **kw: Any) -> list[Any]:
        """``method`` on every server at once, waited for; their answers in server order."""
        return self.submit_all(method, *args, **kw).result()

    @property
    def closed(self) -> bool:
        return self._loop.is_closed()

    def close(self) -> None:
        """Close every client, then stop and close the loop."""
        if self._loop.is_closed():
            return

        async def close_clients() -> None:
            await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)

        self.run(close_clients())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
