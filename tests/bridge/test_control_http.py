"""The client's control-call transport (``ControlConnections``) against a scripted HTTP server.

The real SGLang server (uvicorn) answers with Content-Length bodies, which the weight-sync tests cover
end to end; here each response framing, connection reuse and every failure is checked on real loopback
sockets: what is retried, what is not (a weight update must never be sent twice), and which error
names the server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from sglang_bridge.client import ServerGoneError, SGLangClient, SGLangHTTPError
from sglang_bridge.transport import ControlConnections

Reply = Callable[[dict[str, Any], asyncio.StreamWriter], Awaitable[bool]]
"""Writes the response to one request (its decoded JSON body); returns False to close the connection."""


async def _read_request(r: asyncio.StreamReader) -> tuple[str, dict[str, str], dict[str, Any]]:
    head = (await r.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    fields = dict(line.split(": ", 1) for line in head[1:] if line)
    body = await r.readexactly(int(fields["Content-Length"]))
    return head[0], fields, json.loads(body)


class Scripted:
    """A loopback HTTP server that answers request i with ``replies[i]`` and records what it saw."""

    def __init__(self, replies: list[Reply]):
        self.replies = replies
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.connections = 0

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    req = await _read_request(r)
                except asyncio.IncompleteReadError:
                    return
                self.requests.append(req)
                if not await self.replies[len(self.requests) - 1](req[2], w):
                    return
        finally:
            w.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


def length(status: int = 200, body: Any = None, close: bool = False) -> Reply:
    async def reply(req: dict[str, Any], w: asyncio.StreamWriter) -> bool:
        data = json.dumps({"success": True, "echo": req} if body is None else body).encode()
        conn = "Connection: close\r\n" if close else ""
        w.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(data)}\r\n{conn}\r\n".encode() + data)
        await w.drain()
        return not close

    return reply


def chunked(parts: list[bytes]) -> Reply:
    async def reply(req: dict[str, Any], w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for p in parts:
            w.write(b"%x;ext=1\r\n%s\r\n" % (len(p), p))
            await w.drain()
        w.write(b"0\r\nX-Trailer: 1\r\n\r\n")
        await w.drain()
        return True

    return reply


def until_close(body: bytes) -> Reply:
    async def reply(req: dict[str, Any], w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\n\r\n" + body)
        await w.drain()
        return False

    return reply


async def hang_up(req: dict[str, Any], w: asyncio.StreamWriter) -> bool:
    """The server dies mid-request: the connection closes with no answer."""
    return False


async def garbled(req: dict[str, Any], w: asyncio.StreamWriter) -> bool:
    """Not HTTP: no status code on the first line."""
    w.write(b"NONSENSE\r\n\r\n")
    await w.drain()
    return False


def silent(seconds: float) -> Reply:
    async def reply(req: dict[str, Any], w: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(seconds)
        return False

    return reply


def client(url: str, **kw: Any) -> SGLangClient:
    return SGLangClient(url, retries=2, backoff_s=0.01, api_key="k3y", **kw)


def test_every_response_framing_and_connection_reuse():
    async def go() -> None:
        replies = [
            length(),
            length(),
            chunked([b'{"success": ', b"true}"]),
            length(close=True),
            until_close(b"ok"),
        ]
        srv = Scripted([*replies, length()])
        async with srv as url:
            c = client(url)
            assert (await c.begin_weight_update())["echo"] == {}
            assert (await c.update_weight_version("v1"))["echo"]["new_version"] == "v1"
            assert await c.continue_generation() == {"success": True}  # chunked, with extension and trailer
            assert srv.connections == 1  # one keep-alive connection so far
            await c.pause_generation("abort")  # Connection: close -> not reused
            assert await c.end_weight_update() == "ok"  # body delimited by the close; not JSON -> text
            await c.flush_cache()
            assert srv.connections == 3
            line, headers, _ = srv.requests[0]
            assert line == "POST /begin_weight_update HTTP/1.1"
            assert headers["Authorization"] == "Bearer k3y" and headers["Content-Type"] == "application/json"
            await c.aclose()

    asyncio.run(go())


def test_concurrent_calls_use_separate_connections():
    async def go() -> None:
        async def slow(req: dict[str, Any], w: asyncio.StreamWriter) -> bool:
            await asyncio.sleep(0.2)
            return await length()(req, w)

        srv = Scripted([slow, length(), length()])
        async with srv as url:
            c = client(url)
            a, b = await asyncio.gather(c.update_weight_version("a"), c.update_weight_version("b"))
            assert {a["echo"]["new_version"], b["echo"]["new_version"]} == {"a", "b"}
            assert srv.connections == 2
            await c.update_weight_version("c")  # an idle one is reused
            assert srv.connections == 2
            await c.aclose()

    asyncio.run(go())


def test_an_idle_connection_is_not_reused_past_idle_s(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(ControlConnections, "IDLE_S", 0.05)

    async def go() -> None:
        srv = Scripted([length(), length()])
        async with srv as url:
            c = client(url)
            await c.begin_weight_update()
            await asyncio.sleep(0.1)  # the server could be closing it now (uvicorn: after 5 s)
            await c.begin_weight_update()
            assert srv.connections == 2
            await c.aclose()

    asyncio.run(go())


def test_error_status_names_server_and_path():
    async def go() -> None:
        srv = Scripted([length(400, {"message": "session already open"})])
        async with srv as url:
            c = client(url)
            with pytest.raises(SGLangHTTPError, match=r"/begin_weight_update -> HTTP 400.*already open") as e:
                await c.begin_weight_update()
            assert e.value.status == 400 and url in str(e.value)
            await c.aclose()

    asyncio.run(go())


def test_a_weight_update_dropped_mid_request_is_never_sent_twice():
    async def go() -> None:
        srv = Scripted([hang_up, length()])
        async with srv as url:
            c = client(url)
            with pytest.raises(
                ServerGoneError, match=r"dropped /update_weights_from_distributed.*not retried"
            ):
                await c.update_weights_from_distributed(["w"], ["bfloat16"], [[2]], "g")
            assert len(srv.requests) == 1
            await c.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("failure", [hang_up, garbled], ids=["hang-up", "garbled"])
def test_an_idempotent_call_dropped_mid_request_is_retried(failure: Reply):
    async def go() -> None:
        srv = Scripted([failure, length()])
        async with srv as url:
            c = client(url)
            assert (await c.continue_generation())["success"]
            assert len(srv.requests) == 2
            await c.aclose()

    asyncio.run(go())


def test_unreachable_server_is_retried_then_named():
    async def go() -> None:
        srv = Scripted([])
        async with srv as url:
            pass  # closed: nothing listens on the port any more
        c = client(url)
        with pytest.raises(
            ServerGoneError, match=rf"{url} unreachable for /pause_generation after 3 attempts"
        ):
            await c.pause_generation()
        await c.aclose()

    asyncio.run(go())


def test_no_answer_within_the_timeout():
    async def go() -> None:
        srv = Scripted([silent(5.0)])
        async with srv as url:
            c = client(url, timeout_s=0.2)
            with pytest.raises(TimeoutError, match=r"/end_weight_update did not answer within the timeout"):
                await c.end_weight_update()
            await c.aclose()

    asyncio.run(go())
