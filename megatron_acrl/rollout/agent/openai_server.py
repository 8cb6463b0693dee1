"""An OpenAI-compatible endpoint per agent session: an agent written against the ``openai`` client
trains unchanged.

Each trajectory gets its own base URL, ``http://127.0.0.1:<port>/sessions/<id>/v1``; the agent
points an ``openai`` client there and calls ``chat.completions.create(messages=..., tools=...)``
as it would against any server::

    from megatron_acrl.rollout.agent.openai_server import openai_agent

    @openai_agent
    async def my_agent(base_url, sample):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
        messages = [{"role": "user", "content": sample.text}]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        ...
        return reward                       # or (reward, reason)

and ``rollout.agent.agent: mypkg.module:my_agent`` runs it. The endpoint serves the session
(:class:`~megatron_acrl.rollout.agent.session.AgentSession`) the rollout made for the trajectory, so
everything the session records is recorded here too: the exact token ids (token-in-token-out), the
server's log-probs, the weight version of every generated id, routed experts when the servers
return them, and the turn of each id.

The OpenAI API is stateless (each call sends the whole conversation); a session is not: each call's
``messages`` must extend the previous call's, with the assistant reply it returned in between
(compared by role, and by content for every message but the assistant replies, which a client may
re-serialize: their ids are held already). Only the messages after that reply are appended, as a
suffix against the chat template. A call that rewrites history is refused (HTTP 400 naming the first
message that differs): a trajectory is append-only. ``n`` must be 1; ``temperature``, ``top_p``,
``max_tokens`` / ``max_completion_tokens`` override the run's sampling for that turn. Tool calls in
the model's output (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) come back as the
message's ``tool_calls``; ``tool`` messages go back into the template as tool turns.

One endpoint serves every session of an event loop (:func:`endpoint`), and
:func:`close_endpoints` stops it (the rollout calls it before its loop ends).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from megatron_acrl.rollout.agent.session import AgentSession, TrajectoryEnd
from megatron_acrl.rollout.agent.tools import TOOL_CALL_RE

OpenAIAgentFn = Callable[[str, Any], Awaitable[Any]]
"""``agent(base_url, sample) -> reward | (reward, reason)``."""


class HistoryMismatch(ValueError):
    """A call's messages do not extend the session's conversation."""


@dataclasses.dataclass
class _Served:
    session: AgentSession
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The conversation as the client sent it, with the replies returned (role + content)."""
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    end: TrajectoryEnd | None = None


def _plain(m: dict[str, Any]) -> dict[str, Any]:
    """A message as the template renders it: role, content and tool calls ``{name, arguments}``."""
    out: dict[str, Any] = {"role": str(m.get("role", "")), "content": m.get("content") or ""}
    if isinstance(out["content"], list):  # OpenAI content parts: the text ones, joined
        out["content"] = "".join(p.get("text", "") for p in out["content"] if isinstance(p, dict))
    calls = m.get("tool_calls") or []
    if calls:
        fns = [c.get("function", c) for c in calls]
        out["tool_calls"] = [{"name": f.get("name"), "arguments": _args(f.get("arguments"))} for f in fns]
    return out


def _args(a: Any) -> Any:
    if isinstance(a, str):
        try:
            return json.loads(a)
        except json.JSONDecodeError:
            return a
    return a


def new_messages(held: list[dict[str, Any]], sent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages of ``sent`` after the held conversation and the last reply (module doc);
    raises :class:`HistoryMismatch` naming the first message that differs."""
    if not held:
        return [_plain(m) for m in sent]
    if len(sent) <= len(held):
        raise HistoryMismatch(
            f"the call sends {len(sent)} messages, the session holds {len(held)}: send the whole "
            "conversation so far (the reply returned included) plus the new messages"
        )
    for i, (h, m) in enumerate(zip(held, sent, strict=False)):
        p = _plain(m)
        same = p["role"] == h["role"] and (h["role"] == "assistant" or p["content"] == h["content"])
        if not same:
            raise HistoryMismatch(
                f"message {i} ({p['role']}: {str(p['content'])[:60]!r}) is not the one this session "
                f"holds there ({h['role']}: {str(h['content'])[:60]!r}); a session's trajectory is "
                "append-only (token-in-token-out): start a new session to change earlier turns"
            )
    return [_plain(m) for m in sent[len(held) :]]


def parse_reply(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The model's turn as an OpenAI message: (content without the tool-call markup, tool_calls)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for k, m in enumerate(TOOL_CALL_RE.finditer(text)):
        try:
            body = json.loads(m.group(1))
            name, arguments = str(body["name"]), body.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # malformed markup stays in the content, for the agent to see
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(
            {
                "id": f"call_{k}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        )
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


class Endpoint:
    """The aiohttp app serving ``/sessions/<id>/v1/chat/completions`` for adopted sessions."""

    def __init__(self) -> None:
        self.sessions: dict[str, _Served] = {}
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Endpoint:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        app.router.add_get("/sessions/{sid}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # a free port, held from here on (no race with another binder)
        self.port = int(sock.getsockname()[1])
        await web.SockSite(self._runner, sock).start()
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def adopt(self, session: AgentSession) -> str:
        """Serve ``session``; returns its base URL (what ``openai.AsyncOpenAI(base_url=...)`` takes)."""
        sid = f"s{next(self._ids)}"
        self.sessions[sid] = _Served(session)
        return f"{self.url}/sessions/{sid}/v1"

    def release(self, base_url: str) -> _Served | None:
        return self.sessions.pop(base_url.rstrip("/").split("/")[-2], None)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        served = self.sessions.get(request.match_info["sid"])
        if served is None:
            return _error(404, f"no session {request.match_info['sid']!r} (it ended, or was never made)")
        try:
            body = await request.json()
        except json.JSONDecodeError as err:
            return _error(400, f"the body is not JSON: {err}")
        async with served.lock:
            return await self._turn(served, body)

    async def _turn(self, served: _Served, body: dict[str, Any]) -> web.Response:
        if served.end is not None:
            return _error(400, f"the trajectory ended ({served.end.reason}): {served.end}")
        if int(body.get("n") or 1) != 1:
            return _error(400, "n: a session generates one reply per call; n must be 1")
        sent = body.get("messages")
        if not isinstance(sent, list) or not sent:
            return _error(400, "messages: a non-empty list of chat messages is required")
        try:
            new = new_messages(served.messages, sent)
        except HistoryMismatch as err:
            return _error(400, str(err))
        session = served.session
        if not served.messages and body.get("tools"):
            session.tools = [t.get("function", t) for t in body["tools"]]
        old = session.params
        session.params = _overrides(old, body)
        t = session.traj
        n_before, gen_before = len(t.output_ids) + len(t.prompt_ids), sum(t.generated)
        try:
            text = await session.generate(new)
        except TrajectoryEnd as end:
            served.end = end
            return _error(400, f"the trajectory ended ({end.reason}): {end}")
        finally:
            session.params = old
        content, calls = parse_reply(text)
        served.messages += new
        served.messages.append({"role": "assistant", "content": content})
        finish = "tool_calls" if calls else ("stop" if session.last_turn_closed else "length")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        completion = sum(t.generated) - gen_before
        return web.json_response(
            {
                "id": f"chatcmpl-{id(served):x}-{t.turns}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": str(body.get("model") or "policy"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {
                    "prompt_tokens": n_before,
                    "completion_tokens": completion,
                    "total_tokens": n_before + completion,
                },
                "weight_version": t.weight_version,
            }
        )


def _overrides(params: Any, body: dict[str, Any]) -> Any:
    """The run's sampling with the call's own ``temperature`` / ``top_p`` / token limit."""
    change: dict[str, Any] = {}
    if body.get("temperature") is not None:
        change["temperature"] = float(body["temperature"])
    if body.get("top_p") is not None:
        change["top_p"] = float(body["top_p"])
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if limit is not None:
        change["max_new_tokens"] = min(int(limit), params.max_new_tokens)
    return dataclasses.replace(params, **change) if change else params


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status == 400 else "not_found_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


_ENDPOINTS: dict[asyncio.AbstractEventLoop, Endpoint] = {}


async def endpoint() -> Endpoint:
    """The running event loop's endpoint (started on first use)."""
    loop = asyncio.get_running_loop()
    if loop not in _ENDPOINTS:
        _ENDPOINTS[loop] = await Endpoint().start()
    return _ENDPOINTS[loop]


async def close_endpoints() -> None:
    """Stop the running event loop's endpoint, if it started one."""
    ep = _ENDPOINTS.pop(asyncio.get_running_loop(), None)
    if ep is not None:
        await ep.close()


def openai_agent(fn: OpenAIAgentFn) -> Callable[[AgentSession, Any], Awaitable[Any]]:
    """Make ``fn(base_url, sample)``, an agent that talks to an OpenAI-compatible server, an agent
    of the rollout (``agent(session, sample)``): its session is served at ``base_url`` while it runs.
    A limit that ended the trajectory inside a call (``max_turns``, ``max_tokens``) is what ends it,
    whatever the agent did with the HTTP error."""

    @functools.wraps(fn)
    async def agent(session: AgentSession, sample: Any) -> Any:
        ep = await endpoint()
        base_url = ep.adopt(session)
        try:
            result = await fn(base_url, sample)
        except Exception as err:
            served = ep.release(base_url)
            if served is not None and served.end is not None:
                raise served.end from err  # the agent only saw the limit as an HTTP error
            raise
        served = ep.release(base_url)
        if served is not None and served.end is not None:
            raise served.end
        return result

    return agent
