"""The client's HTTP transport pieces: its error types, and the keep-alive connections its small JSON
control calls go over (:class:`ControlConnections`).

Every request carries the client's key in :func:`auth_headers`. Errors: a non-2xx answer is
:class:`SGLangHTTPError` (with the server's message; a refused key says so); a server that cannot
be reached is :class:`ServerGoneError`; a connection that failed after its request was written is
:class:`RequestDropped` (the server may or may not have acted on it, so a call that must not run
twice is not retried).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from typing import Any

import orjson

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""What sglang-router's ``consistent_hashing`` policy hashes to pick a worker; servers ignore it."""


class HTTPAnswer:
    """A response: status and body (the aiohttp response is released before it is used)."""

    __slots__ = ("status", "body")

    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return orjson.loads(self.body)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The headers that carry ``api_key`` (SGLang's bearer scheme); none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class SGLangHTTPError(RuntimeError):
    """The server answered with an error status."""

    def __init__(self, url: str, path: str, status: int, body: str):
        self.status, self.body = status, body
        hint = ""
        if status in (401, 403):
            hint = " (the server refused this client's API key: it was started with another key, or none)"
        super().__init__(f"{url}{path} -> HTTP {status}{hint}: {body[:500]}")


class ServerGoneError(ConnectionError):
    """The server cannot be reached (it died, or never came up)."""


class RequestDropped(ConnectionError):
    """A connection failed after its request was written."""


class ControlConnections:
    """Keep-alive HTTP/1.1 connections to one server for its small JSON control calls (pause,
    continue, the weight-update endpoints: everything :meth:`sglang_bridge.client.SGLangClient._post` sends).

    A weight sync is a chain of such calls, each waiting for the one before (pause, begin, one per
    bucket, end, version, continue). Through httpx each took ~2.8 ms; the same request written on a
    plain asyncio stream took ~1.6 ms (``/update_weight_version`` on a CPU server, medians of 200 on
    these 2-core machines; the event-loop hand-off is 0.08 ms of that). The difference is the
    client's own per-request machinery, about 1 ms of every link of the chain. This speaks just the
    HTTP/1.1 those calls need: a JSON body out; a Content-Length, chunked or read-to-close body back.
    ``/generate`` goes through aiohttp (:mod:`sglang_bridge.client`).

    One request per connection at a time; a second concurrent call (the next bucket's request while
    the previous one is loading) opens or reuses another. An idle connection is reused only within
    :attr:`IDLE_S`: uvicorn closes idle ones after 5 s (``--timeout-keep-alive``), and a request
    written into a connection the server is closing would look like a server dropping it mid-request.
    """

    IDLE_S = 2.0

    def __init__(self, url: str, headers: dict[str, str]):
        u = urllib.parse.urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._head = f"Host: {u.netloc}\r\nContent-Type: application/json\r\n{extra}"
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []

    async def _connect(self, timeout_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            r, w, since = self._idle.pop()
            if time.monotonic() - since < self.IDLE_S and not (r.at_eof() or w.is_closing()):
                return r, w
            w.close()
        try:
            return await asyncio.wait_for(asyncio.open_connection(self.host, self.port), timeout_s)
        except TimeoutError as e:  # like a refused connection: nothing was sent, so it can be retried
            raise ConnectionError(f"connect to {self.host}:{self.port} timed out after {timeout_s}s") from e

    async def post(self, path: str, body: dict[str, Any], timeout_s: float) -> tuple[int, bytes]:
        """POST ``body`` as JSON; returns (status, response body).

        Raises ``OSError`` (refused, unreachable, connect timed out) if no connection could be made
        (nothing was sent), ``TimeoutError`` if no answer came within ``timeout_s``, and
        :class:`RequestDropped` if the connection failed after the request was written (the server may or
        may not have acted on it)."""
        r, w = await self._connect(min(timeout_s, 5.0))
        data = json.dumps(body).encode()
        head = f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head}Content-Length: {len(data)}\r\n\r\n"
        keep = False
        try:
            w.write(head.encode() + data)
            status, keep, payload = await asyncio.wait_for(self._response(w, r), timeout_s)
            return status, payload
        except TimeoutError as e:
            raise TimeoutError(f"no answer within {timeout_s}s") from e
        except (OSError, EOFError, asyncio.LimitOverrunError, ValueError, IndexError) as e:  # or garbled
            raise RequestDropped(f"{type(e).__name__}: {e}") from e
        finally:
            if keep:
                self._idle.append((r, w, time.monotonic()))
            else:
                w.close()

    @staticmethod
    async def _response(w: asyncio.StreamWriter, r: asyncio.StreamReader) -> tuple[int, bool, bytes]:
        """Send what was written to ``w``; (status, connection reusable, body) of the response."""
        await w.drain()
        head = (await r.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        fields = dict(line.split(":", 1) for line in head[1:] if line)
        h = {k.strip().lower(): v.strip().lower() for k, v in fields.items()}
        keep = h.get("connection") != "close"
        if "content-length" in h:
            return status, keep, await r.readexactly(int(h["content-length"]))
        if h.get("transfer-encoding") == "chunked":
            parts = []
            while size := int((await r.readuntil(b"\r\n")).split(b";")[0], 16):
                parts.append(await r.readexactly(size))
                await r.readexactly(2)
            while await r.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                pass
            return status, keep, b"".join(parts)
        return status, False, await r.read()  # delimited by the server closing the connection

    async def aclose(self) -> None:
        for _, w, _ in self._idle:
            w.close()
        self._idle.clear()
