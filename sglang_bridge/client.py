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
:class:`ServerGoneError` names the server (never a hang: every request has a timeout). A
``/generate`` request is timed by its server's progress, not its own age
(:class:`~sglang_bridge.progress.ServerProgress`): it raises ``TimeoutError`` once the server has
finished none of this client's ``/generate`` requests for ``timeout_s`` while it was in flight, so
time spent in a busy server's queue does not count; control calls time out after ``timeout_s``. A non-2xx
answer raises :class:`SGLangHTTPError` with the server's message. A call that must not run twice (a
weight update) is retried only if it never reached the server.

Transport: ``/generate`` goes through aiohttp (a keep-alive pool of ``max_concurrency``
connections, bodies encoded and decoded with orjson); the short JSON control calls (pause,
continue, the weight-update endpoints) through the client's own keep-alive connections
(:class:`~sglang_bridge.transport.ControlConnections`), ~1 ms cheaper per call, which a weight sync
makes eight of in a row. The client must never be the bottleneck of a rollout: on a CPU machine
its CPU time is taken from the servers', so what it does per request is kept to one encode, one
decode and one pass over the log-probs (``benchmarks/rollout_client.py`` measures it against a
bare aiohttp client). The request and answer types are in :mod:`sglang_bridge.samples`, the error
types and the control connections in :mod:`sglang_bridge.transport`; both are re-exported here.

Groups: :meth:`SGLangClient.generate_group` asks for a prompt's ``n`` samples in one request
(SGLang's ``n``): the server computes the prompt's prefix once and decodes the n samples as one
batch. The same request goes through sglang-router, which takes a single sampling-params object,
not the per-sample lists of :meth:`SGLangClient.generate_batch`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Literal, TypeVar

import aiohttp
import orjson
from tqdm.auto import tqdm

from sglang_bridge.progress import ServerProgress
from sglang_bridge.samples import Sample, SamplingParams, decode_routed_experts, target_logprobs
from sglang_bridge.transport import (
    ROUTING_KEY_HEADER,
    ControlConnections,
    HTTPAnswer,
    RequestDropped,
    ServerGoneError,
    SGLangHTTPError,
    auth_headers,
)

_R = TypeVar("_R")

PauseMode = Literal["abort", "retract", "in_place"]


KEEPALIVE_S = 4.0
"""An idle /generate connection is reused only this long: uvicorn closes idle ones after 5 s, and a
request written into a connection the server is closing reads as a server dropping it."""


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
        self.progress = ServerProgress(timeout_s)
        """What times this client's ``/generate`` requests (module doc)."""
        self.max_concurrency = max_concurrency
        self._sem = asyncio.Semaphore(max_concurrency)
        headers = auth_headers(api_key)
        self._headers = {**headers, "Content-Type": "application/json"}
        self._http: aiohttp.ClientSession | None = None  # made on first use, inside the event loop
        self._rid = itertools.count()
        # Control calls over plain keep-alive connections (see ControlConnections); https servers
        # (behind a proxy) go through aiohttp for them too.
        self._control = ControlConnections(self.url, headers) if self.url.startswith("http://") else None

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._control is not None:
            await self._control.aclose()
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=5.0),
                connector=aiohttp.TCPConnector(limit=self.max_concurrency + 8, keepalive_timeout=KEEPALIVE_S),
                json_serialize=lambda o: orjson.dumps(o).decode(),
                skip_auto_headers=("User-Agent",),
            )
        return self._http

    # -- transport ------------------------------------------------------------------------
    async def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        retry_after_send: bool = True,
        timeout_s: float | None = None,
        by_progress: bool = False,
        headers: dict[str, str] | None = None,
    ) -> HTTPAnswer:
        """Send through aiohttp with :meth:`_retrying`'s retries and errors; ``by_progress``: timed by
        :attr:`progress` (``/generate``), not by its own age; ``headers`` added to the session's."""
        data = orjson.dumps(body) if body is not None else None
        if by_progress:
            timeout_s = None  # no total: the progress clock ends a request its server does not serve
        timeout = (
            aiohttp.ClientTimeout(total=timeout_s, sock_connect=5.0)
            if timeout_s is not None or by_progress
            else None
        )

        async def attempt() -> tuple[int, HTTPAnswer]:
            extra: dict[str, Any] = {"timeout": timeout} if timeout else {}
            if headers:
                extra["headers"] = headers
            async with self._session().request(method, self.url + path, data=data, **extra) as r:
                return r.status, HTTPAnswer(r.status, await r.read())

        async def send() -> tuple[int, HTTPAnswer]:
            try:
                return await (self.progress.wait(attempt()) if by_progress else attempt())
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                raise ConnectionError(f"{type(e).__name__}: {e}") from e  # nothing was sent
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                if isinstance(e, asyncio.TimeoutError):  # a read timeout, after the request was sent
                    raise TimeoutError(str(e)) from e
                raise RequestDropped(f"{type(e).__name__}: {e}") from e

        return await self._retrying(path, send, retry_after_send, lambda r: r.text)

    async def _retrying(
        self,
        path: str,
        send: Callable[[], Awaitable[tuple[int, _R]]],
        retry_after_send: bool,
        text: Callable[[_R], str],
    ) -> _R:
        """Run ``send`` (one attempt, returning (status, answer)) with retries and backoff.

        ``send`` raises ``OSError`` when nothing reached the server (always retried), :class:`RequestDropped`
        when the connection failed after the request was written (retried only if
        ``retry_after_send``: a weight update must never run twice) and ``TimeoutError`` when no answer
        came. A status >= 400 raises :class:`SGLangHTTPError` with ``text(answer)``."""
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                status, answer = await send()
            except RequestDropped as e:
                last = e
                if not retry_after_send:
                    raise ServerGoneError(
                        f"SGLang server {self.url} dropped {path} mid-request ({e}); not retried "
                        "(not idempotent)"
                    ) from e
            except TimeoutError as e:  # after the request was sent
                what = f"SGLang server {self.url}{path} did not answer within the timeout"
                raise TimeoutError(f"{what} ({e})" if str(e) else what) from e
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
        :class:`ControlConnections` (aiohttp for an https server)."""
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
    async def _generate(self, body: dict[str, Any], routing_key: str | None = None) -> Any:
        """POST ``/generate`` (one of ``max_concurrency`` in flight, timed by progress); the decoded
        answer. ``routing_key``: sent as sglang-router's :data:`ROUTING_KEY_HEADER`."""
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        async with self._sem:
            return (await self._request("POST", "/generate", body, by_progress=True, headers=headers)).json()

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
        if params.lora_path is not None:
            body["lora_path"] = params.lora_path
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
        return self._sample(prompt, await self._generate(self._body(prompt, params, rid)), params)

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
        if any(sp.lora_path != params[0].lora_path for sp in params):
            body["lora_path"] = [sp.lora_path for sp in params]  # one adapter (None: base) each
        body.update({k: v for k, v in bodies[0].items() if k not in body})  # the scalar fields
        outs = await self._generate(body)
        if not isinstance(outs, list) or len(outs) != len(flat):
            got = len(outs) if isinstance(outs, list) else type(outs).__name__
            raise SGLangHTTPError(self.url, "/generate", 200, f"batch of {len(flat)} answered with {got}")
        return [self._sample(p, o, sp) for p, o, sp in zip(flat, outs, params, strict=True)]

    async def generate_group(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        n: int,
        rid: str | None = None,
        *,
        routing_key: str | None = None,
    ) -> list[Sample]:
        """``n`` samples of one prompt in one ``/generate`` request (SGLang's ``n``): the prompt's
        prefix is computed once and the samples decode together, on one server (also through
        sglang-router, which routes the request as a whole).

        With ``params.seed`` set and ``n > 1`` the samples go as ``n`` requests seeded
        ``seed, seed + 1, ...`` instead (one seed for the whole request would repeat one sample).
        ``routing_key``: sglang-router's :data:`ROUTING_KEY_HEADER` (not on those seeded requests).
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if params.seed is not None and n > 1:
            return list(
                await asyncio.gather(
                    *(self.generate_one(prompt_ids, replace(params, seed=params.seed + j)) for j in range(n))
                )
            )
        prompt = [int(t) for t in prompt_ids]
        body = self._body(prompt, params, rid)
        if n > 1:
            body["sampling_params"]["n"] = n
        outs = await self._generate(body, routing_key)
        outs = [outs] if n == 1 else outs
        if not isinstance(outs, list) or len(outs) != n:
            got = len(outs) if isinstance(outs, list) else type(outs).__name__
            raise SGLangHTTPError(self.url, "/generate", 200, f"group of n={n} answered with {got}")
        return [self._sample(prompt, o, params) for o in outs]

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

    async def score(
        self,
        sequences: Sequence[Sequence[int]],
        target_lens: Sequence[int],
        per_request: int = 256,
        *,
        lora_path: str | None = None,
    ) -> list[list[float]]:
        """Teacher-forced log-probs of the last ``target_lens[i]`` tokens of ``sequences[i]`` under
        the served weights (and KV cache): ``/generate`` with ``max_new_tokens`` 0, ``return_logprob``
        and ``logprob_start_len`` one before the targets. SGLang 0.5.23 returns these prompt log-probs
        (``input_token_logprobs``) of the *unscaled* logits, whatever the request's temperature, and
        ``None`` at ``logprob_start_len`` itself; a prefix cached in the radix tree is not reused past
        ``logprob_start_len``, so every target is recomputed. ``lora_path``: score with that loaded
        LoRA adapter (None: the base weights). Returns ``[i][j]``: log p(target j)."""
        if len(sequences) != len(target_lens):
            raise ValueError(f"{len(sequences)} sequences but {len(target_lens)} target lengths")
        flat = [[int(t) for t in s] for s in sequences]
        for s, k in zip(flat, target_lens, strict=True):
            if not 1 <= k < len(s):
                raise ValueError(
                    f"target length {k} must be in [1, {len(s) - 1}] for a {len(s)}-token sequence"
                )

        async def chunk(lo: int) -> list[list[float]]:
            seqs, lens = flat[lo : lo + per_request], list(target_lens[lo : lo + per_request])
            body = {
                "input_ids": seqs,
                "sampling_params": [{"max_new_tokens": 0, "temperature": 1.0}] * len(seqs),
                "return_logprob": True,
                "logprob_start_len": [len(s) - k - 1 for s, k in zip(seqs, lens, strict=True)],
                "rid": [f"acrl-score-{id(self):x}-{next(self._rid)}" for _ in seqs],
            }
            if lora_path is not None:
                body["lora_path"] = lora_path
            outs = await self._generate(body)
            if not isinstance(outs, list) or len(outs) != len(seqs):
                raise SGLangHTTPError(
                    self.url, "/generate", 200, f"scoring {len(seqs)} sequences: {outs!r:.200}"
                )
            return [target_logprobs(o, s, k, self.url) for o, s, k in zip(outs, seqs, lens, strict=True)]

        parts = await asyncio.gather(*(chunk(lo) for lo in range(0, len(flat), per_request)))
        return [x for part in parts for x in part]

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
