"""Async client for one SGLang server: ``/generate`` with log-probs, and the weight-update endpoints.

    async with SGLangClient(url) as c:
        groups = await c.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=1.0), n=4)
        groups[0][2].rollout_logprobs  # per output token, float, len == len(output_ids)

Log-prob temperature semantics (SGLang 0.5.23, ``layers/sampler.py``): the returned log-prob of a
sampled token is ``log softmax(logits / T)[token]`` over the full vocabulary (temperature applied,
before top-p/top-k truncation of the sampling distribution), unless the *server* was started with
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (:attr:`ServerSpec.original_logprobs`), in which case it is
``log softmax(logits)[token]``. Greedy requests (T=0) always get ``log softmax(logits)``. Each
:class:`Sample` records the temperature its log-probs are at in ``logprob_temperature`` so the
trainer can compute matching log-probs; the client is told the server's mode (``original_logprobs``)
rather than guessing it.

Routed experts (MoE routing replay, R3): with ``routed_experts_topk=k`` a request asks for
``return_routed_experts`` (the server must run with ``--enable-return-routed-experts``, else SGLang
silently drops the field) and :attr:`Sample.routed_experts` holds the decoded routing: SGLang sends
base64 of raw int32 ``[P + O - 1, num_layers, k]``, one row per absolute position 0 .. P+O-2 of the
prompt + output (the last output token was never fed through the model), experts in descending
router probability.

Errors: connection failures are retried with exponential backoff; after ``retries`` attempts a
:class:`ServerGoneError` names the server (never a hang: every request has a timeout). A non-2xx
answer raises :class:`SGLangHTTPError` with the server's message. A call that must not run twice (a
weight update) is retried only if it never reached the server.

Transport: ``/generate`` goes through httpx; the short JSON control calls (pause, continue, the
weight-update endpoints) through the client's own keep-alive connections (``_ControlConnections``),
~1 ms cheaper per call, which a weight sync makes eight of in a row.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, TypeVar

import httpx
import numpy as np
from tqdm.auto import tqdm

_R = TypeVar("_R")

PauseMode = Literal["abort", "retract", "in_place"]


class SGLangHTTPError(RuntimeError):
    """The server answered with an error status."""

    def __init__(self, url: str, path: str, status: int, body: str):
        self.status, self.body = status, body
        super().__init__(f"{url}{path} -> HTTP {status}: {body[:500]}")


class ServerGoneError(ConnectionError):
    """The server cannot be reached (it died, or never came up)."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (SGLang ``sampling_params``)."""

    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    """Per-request sampling seed (``sampling_seed``); None lets the server draw."""

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            d["sampling_seed"] = self.seed
        return d


@dataclass
class Sample:
    """One generated continuation of a prompt."""

    prompt_ids: list[int]
    output_ids: list[int]
    rollout_logprobs: list[float]
    """Rollout log-prob (log mu) of each output token, ``len == len(output_ids)``, at
    ``logprob_temperature``."""
    finish_reason: str
    """"stop" (EOS / stop token), "length" (max_new_tokens) or "abort"."""
    weight_version: str
    """Weight version reported when the request finished."""
    weight_versions: list[dict[str, Any]] = field(default_factory=list)
    """Segments ``{"version", "start", "end"}`` over output tokens; a request paused across an update
    spans two."""
    logprob_temperature: float = 1.0
    """Temperature the log-probs are computed at (see the module docstring)."""
    server: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    routed_experts: np.ndarray | None = None
    """MoE routing of positions ``0 .. len(prompt_ids) + len(output_ids) - 2``: int32 ``[P + O - 1,
    num_layers, top_k]`` (None unless requested; see the module docstring)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_CONN_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.PoolTimeout,
)


def decode_routed_experts(encoded: str, num_positions: int, topk: int) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]`` -> int32 ``[num_positions, num_layers, topk]``.

    Raises ``ValueError`` when the payload does not hold ``num_positions`` rows of a whole number of
    layers (a request sent with a nonzero ``routed_experts_start_len``, or a wrong ``topk``).
    """
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    per_row = topk * num_positions
    if num_positions <= 0 or flat.size % per_row:
        raise ValueError(
            f"routed_experts holds {flat.size} int32 values, not num_positions={num_positions} x "
            f"num_layers x top_k={topk}"
        )
    return flat.reshape(num_positions, flat.size // per_row, topk).copy()


class _ControlConnections:
    """Keep-alive HTTP/1.1 connections to one server for its small JSON control calls (pause,
    continue, the weight-update endpoints: everything :meth:`SGLangClient._post` sends).

    A weight sync is a chain of such calls, each waiting for the one before (pause, begin, one per
    bucket, end, version, continue). Through httpx each took ~2.8 ms; the same request written on a
    plain asyncio stream took ~1.6 ms (``/update_weight_version`` on a CPU server, medians of 200 on
    these 2-core machines; the event-loop hand-off is 0.08 ms of that). The difference is the
    client's own per-request machinery, about 1 ms of every link of the chain. This speaks just the
    HTTP/1.1 those calls need: a JSON body out; a Content-Length, chunked or read-to-close body back.
    ``/generate`` stays on httpx.

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
        :class:`_Dropped` if the connection failed after the request was written (the server may or
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
            raise _Dropped(f"{type(e).__name__}: {e}") from e
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


class _Dropped(ConnectionError):
    """A control connection failed after its request was written."""


class SGLangClient:
    """Client of one server; use as ``async with`` (or call :meth:`aclose`).

    ``routed_experts_topk``: the served MoE model's top-k; set it to request and decode routed experts.
    ``samples_per_request``: samples batched into one ``/generate`` request by :meth:`generate`
    (1: one request per sample); ``max_concurrency`` bounds the requests in flight.
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        original_logprobs: bool = False,
        routed_experts_topk: int | None = None,
        samples_per_request: int = 64,
    ):
        self.url = url.rstrip("/")
        self.samples_per_request = samples_per_request
        self.routed_experts_topk = routed_experts_topk
        self.retries = retries
        self.backoff_s = backoff_s
        self.original_logprobs = original_logprobs
        self.timeout_s = timeout_s
        self._sem = asyncio.Semaphore(max_concurrency)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(
                max_connections=max_concurrency + 8, max_keepalive_connections=max_concurrency
            ),
        )
        self._rid = itertools.count()
        # Control calls over plain keep-alive connections (see _ControlConnections); https servers
        # (behind a proxy) keep using httpx for them.
        self._control = _ControlConnections(self.url, headers) if self.url.startswith("http://") else None

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._control is not None:
            await self._control.aclose()
        await self._http.aclose()

    # -- transport ------------------------------------------------------------------------
    async def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        retry_after_send: bool = True,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        """Send through httpx with :meth:`_retrying`'s retries and errors."""

        async def send() -> tuple[int, httpx.Response]:
            try:
                r = await self._http.request(
                    method,
                    self.url + path,
                    json=body,
                    timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT,
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                raise ConnectionError(f"{type(e).__name__}: {e}") from e
            except _CONN_ERRORS as e:
                raise _Dropped(f"{type(e).__name__}: {e}") from e
            except httpx.TimeoutException as e:
                raise TimeoutError(str(e)) from e
            return r.status_code, r

        return await self._retrying(path, send, retry_after_send, lambda r: r.text)

    async def _retrying(
        self,
        path: str,
        send: Callable[[], Awaitable[tuple[int, _R]]],
        retry_after_send: bool,
        text: Callable[[_R], str],
    ) -> _R:
        """Run ``send`` (one attempt, returning (status, answer)) with retries and backoff.

        ``send`` raises ``OSError`` when nothing reached the server (always retried), :class:`_Dropped`
        when the connection failed after the request was written (retried only if
        ``retry_after_send``: a weight update must never run twice) and ``TimeoutError`` when no answer
        came. A status >= 400 raises :class:`SGLangHTTPError` with ``text(answer)``."""
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                status, answer = await send()
            except _Dropped as e:
                last = e
                if not retry_after_send:
                    raise ServerGoneError(
                        f"SGLang server {self.url} dropped {path} mid-request ({e}); not retried "
                        "(not idempotent)"
                    ) from e
            except TimeoutError as e:  # after the request was sent
                raise TimeoutError(f"SGLang server {self.url}{path} did not answer within the timeout") from e
            except OSError as e:  # could not connect: nothing was sent
                last = e
            else:
                if status >= 400:
                    raise SGLangHTTPError(self.url, path, status, text(answer))
                return answer
            if attempt < self.retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise ServerGoneError(
            f"SGLang server {self.url} unreachable for {path} after {self.retries + 1} attempts "
            f"({type(last).__name__}: {last}); is it still running?"
        ) from last

    async def _post(
        self, path: str, body: dict[str, Any] | None = None, *, retry_after_send: bool = True
    ) -> Any:
        """A control call: POST a JSON body, return the decoded JSON answer (or its text), over
        :class:`_ControlConnections` (httpx for an https server)."""
        if self._control is None:
            text = (await self._request("POST", path, body or {}, retry_after_send=retry_after_send)).text
        else:
            control = self._control

            async def send() -> tuple[int, str]:
                status, payload = await control.post(path, body or {}, self.timeout_s)
                return status, payload.decode("utf-8", errors="replace")

            text = await self._retrying(path, send, retry_after_send, lambda t: t)
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    async def _get(self, path: str) -> Any:
        return (await self._request("GET", path)).json()

    # -- generation -----------------------------------------------------------------------
    def logprob_temperature(self, params: SamplingParams) -> float:
        """Temperature at which this server's log-probs for ``params`` are computed."""
        if params.temperature == 0 or self.original_logprobs:
            return 1.0
        return params.temperature

    def _body(self, prompt: list[int], params: SamplingParams, rid: str | None) -> dict[str, Any]:
        if not prompt:
            raise ValueError("empty prompt")
        body: dict[str, Any] = {
            "input_ids": prompt,
            "sampling_params": params.to_json(),
            "return_logprob": True,
            # Log-probs of the output tokens only; the prompt's would cost a full-vocab softmax each.
            "logprob_start_len": len(prompt) - 1,
            "rid": rid or f"acrl-{id(self):x}-{next(self._rid)}",
        }
        if self.routed_experts_topk:
            # From position 0: the prompt's routing shapes the KV every output token attends to.
            body.update(return_routed_experts=True, routed_experts_start_len=0)
        return body

    def _sample(self, prompt: list[int], out: dict[str, Any], params: SamplingParams) -> Sample:
        mi = out["meta_info"]
        rollout_logprobs = [float(x[0]) for x in mi.get("output_token_logprobs") or []]
        finish = mi.get("finish_reason") or {}
        experts = None
        if self.routed_experts_topk:
            if not mi.get("routed_experts"):
                raise SGLangHTTPError(
                    self.url,
                    "/generate",
                    200,
                    "no routed_experts in the answer: start the server with --enable-return-routed-experts "
                    "(ServerSpec.return_routed_experts) and serve an MoE model",
                )
            n_pos = len(prompt) + len(out["output_ids"]) - 1
            experts = decode_routed_experts(mi["routed_experts"], n_pos, self.routed_experts_topk)
        return Sample(
            prompt_ids=prompt,
            output_ids=[int(t) for t in out["output_ids"]],
            rollout_logprobs=rollout_logprobs,
            finish_reason=finish.get("type", "unknown") if isinstance(finish, dict) else str(finish),
            weight_version=str(mi.get("weight_version", "")),
            weight_versions=list(mi.get("weight_versions") or []),
            logprob_temperature=self.logprob_temperature(params),
            server=self.url,
            meta={k: mi[k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "id") if k in mi},
            routed_experts=experts,
        )

    async def generate_one(
        self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None
    ) -> Sample:
        """One sample for one prompt (token ids in, token ids + log-probs out)."""
        prompt = [int(t) for t in prompt_ids]
        body = self._body(prompt, params, rid)
        async with self._sem:
            out = (await self._request("POST", "/generate", body)).json()
        return self._sample(prompt, out, params)

    async def generate_batch(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[Sample]:
        """One sample for each of ``prompts`` (``params[i]`` for prompt i) in a single ``/generate``
        request: SGLang admits the whole batch into one prefill and decodes it together."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        flat = [[int(t) for t in p] for p in prompts]
        bodies = [self._body(p, sp, None) for p, sp in zip(flat, params, strict=True)]
        per_sample = ("input_ids", "sampling_params", "logprob_start_len", "rid")
        body = {k: [b[k] for b in bodies] for k in per_sample}
        body.update({k: v for k, v in bodies[0].items() if k not in body})  # the scalar fields
        async with self._sem:
            outs = (await self._request("POST", "/generate", body)).json()
        if not isinstance(outs, list) or len(outs) != len(flat):
            got = len(outs) if isinstance(outs, list) else type(outs).__name__
            raise SGLangHTTPError(self.url, "/generate", 200, f"batch of {len(flat)} answered with {got}")
        return [self._sample(p, o, sp) for p, o, sp in zip(flat, outs, params, strict=True)]

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        n: int = 1,
        *,
        progress: bool | None = None,
        desc: str = "rollout",
        samples_per_request: int | None = None,
    ) -> list[list[Sample]]:
        """``n`` samples for each prompt, at most ``max_concurrency`` requests in flight.

        Samples go ``samples_per_request`` to a ``/generate`` request (default: the client's). Batched
        requests are how a CPU server stays fast: each request that arrives on its own is prefilled in
        its own forward pass between the running batch's decode steps, so one-sample requests cost
        several times more forward passes than a batch admitted at once (measured: 256 samples of a
        tiny model 3x faster in batches of 64-256 than as single requests).

        Returns ``groups[i][j]``: sample j of prompt i. A progress bar is shown when ``progress`` is
        True, or by default when there are more than 64 samples and stderr is a terminal (a log file
        of a batch job or a study run gets no bar lines).
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        per_req = self.samples_per_request if samples_per_request is None else samples_per_request
        if per_req < 1:
            raise ValueError(f"samples_per_request must be >= 1, got {per_req}")
        total = len(prompts) * n
        bar = tqdm(
            total=total,
            desc=desc,
            unit="sample",
            disable=not (progress if progress is not None else total > 64 and sys.stderr.isatty()),
        )
        seeds = None if params.seed is None else itertools.count(params.seed)
        order = [i for i in range(len(prompts)) for _ in range(n)]
        # Per-sample seeds in sample order, so a seeded rollout does not depend on the batching.
        sps = [params if seeds is None else replace(params, seed=next(seeds)) for _ in order]

        async def chunk(lo: int) -> list[Sample]:
            idx = order[lo : lo + per_req]
            if per_req == 1:
                out = [await self.generate_one(prompts[idx[0]], sps[lo])]
            else:
                out = await self.generate_batch([prompts[i] for i in idx], sps[lo : lo + per_req])
            bar.update(len(out))
            return out

        try:
            tasks = [asyncio.ensure_future(chunk(lo)) for lo in range(0, total, per_req)]
            try:
                flat = [s for part in await asyncio.gather(*tasks) for s in part]
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        finally:
            bar.close()
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    # -- control and weight-update endpoints --------------------------------------------------
    async def health(self) -> bool:
        """True if the server answers ``/model_info``."""
        try:
            await self._request("GET", "/model_info", timeout_s=5.0)
            return True
        except (ServerGoneError, SGLangHTTPError, TimeoutError):
            return False

    async def model_info(self) -> dict[str, Any]:
        """``/model_info``: model_path, weight_version, ..."""
        return await self._get("/model_info")

    async def weight_version(self) -> str:
        """The server's current weight version (``/get_weight_version`` does not exist in 0.5.23)."""
        return str((await self.model_info())["weight_version"])

    async def pause_generation(self, mode: PauseMode = "retract") -> Any:
        """Stop scheduling: ``retract`` re-queues running requests (KV recomputed after continue),
        ``abort`` ends them with finish_reason "abort", ``in_place`` keeps their KV cache."""
        return await self._post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> Any:
        return await self._post("/continue_generation", {})

    async def flush_cache(self, attempts: int = 30, wait_s: float = 0.01) -> None:
        """Flush the radix cache. SGLang answers 400 while requests are still being retracted or
        aborted after a pause, so retry with backoff (``wait_s`` doubling up to 0.5 s)."""
        for i in range(attempts):
            try:
                await self._post("/flush_cache")
                return
            except SGLangHTTPError as e:
                if e.status != 400 or i == attempts - 1:
                    raise
                await asyncio.sleep(min(wait_s * 2**i, 0.5))

    async def begin_weight_update(self) -> Any:
        return await self._post("/begin_weight_update", {})

    async def end_weight_update(self) -> Any:
        """Close the update session (SGLang then runs post-load processing, e.g. FP8 re-packing)."""
        return await self._post("/end_weight_update", {}, retry_after_send=False)

    async def update_weight_version(self, version: str) -> Any:
        # abort_all_requests defaults to True in SGLang: that would kill paused requests.
        return await self._post(
            "/update_weight_version", {"new_version": version, "abort_all_requests": False}
        )

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> Any:
        """Ask the server to join the trainer's update group (blocks until the trainer joins too)."""
        return await self._post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
            retry_after_send=False,
        )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        *,
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> Any:
        """Receive the tensors the trainer broadcasts next on ``group_name`` (one bucket)."""
        return await self._post(
            "/update_weights_from_distributed",
            {
                "names": list(names),
                "dtypes": list(dtypes),
                "shapes": [list(s) for s in shapes],
                "group_name": group_name,
                "load_format": load_format,
                "flush_cache": flush_cache,
                "weight_version": weight_version,
                "abort_all_requests": False,
            },
            retry_after_send=False,
        )

    async def destroy_weights_update_group(self, group_name: str) -> Any:
        return await self._post("/destroy_weights_update_group", {"group_name": group_name})


__all__ = [
    "PauseMode",
    "Sample",
    "SamplingParams",
    "ServerGoneError",
    "SGLangClient",
    "SGLangHTTPError",
    "decode_routed_experts",
]
