"""The torch.distributed broadcast transport (gloo on CPU, NCCL on GPU):
:class:`DistributedWeightSynchronizer`, through SGLang's ``/update_weights_from_distributed``.

One update (:meth:`DistributedWeightSynchronizer.sync`), one lifecycle:

1. validate every (name, shape, dtype) that will be sent against the served model's
   :class:`~sglang_bridge.weight_sync.manifest.Manifest`. A materialised input (dict / list) is
   checked completely before anything touches a server; a one-shot iterator is checked tensor by
   tensor before its bucket is sent;
2. open: pause generation -> ``/begin_weight_update`` (the radix cache is flushed by the last
   bucket's request);
3. send: bucketed broadcasts, each bucket one ``/update_weights_from_distributed`` request in
   ``flattened_bucket`` format (:mod:`~sglang_bridge.weight_sync.buckets`) plus one broadcast from
   rank 0, pipelined one deep on gloo;
4. close: ``/end_weight_update`` (SGLang's post-load processing) -> ``/update_weight_version`` ->
   continue.

The version is advanced only after ``end_weight_update`` succeeded. If anything fails after the open
the update fails: the servers stay *paused* (never generating on half-updated weights) and
:class:`WeightSyncError` says so; calling ``sync`` again with a full set of weights is safe and
resumes generation (after a :class:`WeightSyncTimeoutError`, a server that did not answer in time,
through a new synchronizer).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from sglang_bridge.client import PauseMode, SGLangClient, SGLangHTTPError
from sglang_bridge.fp8 import Fp8Scheme, Fp8Workspace
from sglang_bridge.weight_sync.buckets import (
    Bucket,
    BucketPacker,
    SendBuffers,
    WireEntry,
    bucket_limit,
    group_entries,
    wire_entry,
    wire_meta,
)
from sglang_bridge.weight_sync.interface import (
    ReferenceLogprobs,
    SyncReport,
    VerifyReport,
    WeightSyncError,
    WeightSynchronizer,
    WeightSyncTimeoutError,
)
from sglang_bridge.weight_sync.manifest import Manifest, ManifestMismatchError
from sglang_bridge.weight_sync.server_calls import ServerCalls
from sglang_bridge.weight_sync.update_group import broadcast_async, create_update_group, host_update_store
from sglang_bridge.weight_sync.verify import compare_logprobs, verify_params

log = logging.getLogger(__name__)

_NOT_FLUSHED = "cache was not flushed"
"""SGLang's answer when a bucket loaded but its flush found requests still being retracted."""


@dataclass
class _InFlight:
    """A bucket on its way: the servers' answers (``fut``), the broadcast (``work``), the send buffer
    it occupies (``idx``), ``answered_at``, the ``perf_counter`` time every server had answered
    (0 until then), and ``loaded``, set once every server's answer was checked."""

    bucket: Bucket
    idx: int
    fut: concurrent.futures.Future[Any]
    work: dist.Work
    answered_at: float = 0.0
    loaded: bool = False


@dataclass
class _Update:
    """One sync from open to close or fail: what it sends, its timings, the buckets still on their
    way (sent, not yet loaded by every server: at most two) and what has been sent so far."""

    version: str
    checked: bool
    """The whole input was validated up front (else each tensor is checked as it is packed)."""
    t0: float
    timings: dict[str, float]
    inflight: list[_InFlight] = field(default_factory=list)
    sent: set[str] = field(default_factory=set)
    n_tensors: int = 0
    n_bytes: int = 0
    n_buckets: int = 0
    t_send: float = 0.0
    """``perf_counter`` time the first bucket was asked for."""


class DistributedWeightSynchronizer(WeightSynchronizer):
    """Weight sync through ``/update_weights_from_distributed`` to one or many SGLang servers.

    The trainer is rank 0 of a group with every server's TP ranks (``world = 1 + sum(server_tp)``):
    one broadcast reaches all servers. gloo on CPU, nccl when ``device`` is CUDA; the code path is
    the same. Public methods are blocking and thread-safe to call from a driver loop; HTTP runs on a
    private event loop thread (:class:`ServerCalls`) so they can also be called while other event
    loops run.

    ``fp8``: None sends tensors as given; with a scheme, quantizable weights are FP8-quantized on the
    way ("real": e4m3 + scales, for an FP8 server) or fake-quantized ("fake": FP8-rounded values in
    the original dtype, for a bf16 CPU server; reported as ``fp8="fake-quant"``).
    """

    def __init__(
        self,
        urls: Sequence[str],
        manifest: Manifest,
        *,
        server_tp: int | Sequence[int] = 1,
        api_key: str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str | None = None,
        device: torch.device | str = "cpu",
        bucket_size_mb: float = 512,
        first_bucket_mb: float = 32,
        fp8: Fp8Scheme | None = None,
        fp8_mode: Literal["real", "fake"] = "fake",
        pause_mode: PauseMode = "retract",
        require_complete: bool = True,
        timeout_s: float = 300.0,
    ):
        self.urls = list(urls)
        if not self.urls:
            raise ValueError("no servers")
        self.manifest = manifest
        self.server_tp = [server_tp] * len(self.urls) if isinstance(server_tp, int) else list(server_tp)
        self.api_key = api_key
        self.master_address = master_address
        self.master_port = master_port
        # Unique by default: torch and the server refuse a second group under an existing name.
        self.group_name = group_name or f"acrl_weight_update_{uuid.uuid4().hex[:8]}"
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.bucket_bytes = max(1, int(bucket_size_mb * 1024 * 1024))
        self.first_bucket_bytes = max(1, min(self.bucket_bytes, int(first_bucket_mb * 1024 * 1024)))
        self.fp8 = fp8
        self.fp8_mode = fp8_mode
        self.pause_mode = pause_mode
        self.require_complete = require_complete
        self.timeout_s = timeout_s
        self.version: str | None = None
        self.group: dist.ProcessGroup | None = None
        self._dirty = False  # servers paused on partially updated weights
        self._calls = ServerCalls(self.urls, api_key=api_key, timeout_s=timeout_s)
        self._send_buffers = SendBuffers(self.device)
        self._fp8_ws = Fp8Workspace()  # used by the (one) packing thread only
        self._validated: tuple[Any, ...] | None = None  # key of the last input set that validated

    @property
    def fp8_label(self) -> str:
        if self.fp8 is None:
            return "none"
        return "real" if self.fp8_mode == "real" else "fake-quant"

    # -- connect / close --------------------------------------------------------------------
    def connect(self) -> None:
        """Rendezvous with every server through ``/init_weights_update_group``."""
        if self.group is not None:
            return
        world = 1 + sum(self.server_tp)
        # Bind first, then tell the servers the port the store actually holds (see host_update_store).
        store = host_update_store(
            self.master_address, self.master_port or 0, world, timedelta(seconds=self.timeout_s)
        )
        port = store.port
        offsets = [1 + sum(self.server_tp[:i]) for i in range(len(self.urls))]

        async def init_all() -> list[Any]:
            return list(
                await asyncio.gather(
                    *(
                        c.init_weights_update_group(
                            self.master_address, port, off, world, self.group_name, self.backend
                        )
                        for c, off in zip(self._calls.clients, offsets, strict=True)
                    )
                )
            )

        fut = self._calls.submit(init_all())  # the servers block in rendezvous until we join below
        try:
            self.group = create_update_group(
                self.backend,
                self.master_address,
                port,
                world,
                0,
                self.group_name,
                timedelta(seconds=self.timeout_s),
                store=store,
            )
            results = fut.result(timeout=self.timeout_s)
        except BaseException as e:
            fut.cancel()
            raise WeightSyncError(f"could not form the weight-update group with {self.urls}: {e}") from e
        for url, r in zip(self.urls, results, strict=True):
            if not (isinstance(r, dict) and r.get("success")):
                raise WeightSyncError(f"{url} refused /init_weights_update_group: {r}")
        log.info(
            "weight-update group %s ready: backend=%s world=%d servers=%s",
            self.group_name,
            self.backend,
            world,
            self.urls,
        )

    def close(self) -> None:
        if self._calls.closed:
            return
        if self.group is not None:
            try:
                self._calls.all("destroy_weights_update_group", self.group_name)
            except Exception as e:  # a dead server must not block the trainer's shutdown
                log.warning("destroy_weights_update_group failed: %s", e)
            dist.destroy_process_group(self.group)
            self.group = None
        self._calls.close()

    # -- validation -----------------------------------------------------------------------
    def validate(self, meta: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> None:
        """Raise :class:`ManifestMismatchError` listing every input tensor that would not match."""
        outs = (o for n, s, d in meta for o in wire_meta(n, tuple(s), d, self.fp8, self.fp8_mode))
        self.manifest.validate(outs, require_complete=self.require_complete)

    def _validated_input(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> tuple[Iterable[tuple[str, torch.Tensor]], bool]:
        """The input as ``(name, tensor)`` pairs, and whether it was validated whole (a dict / list:
        checked before anything touches a server; a one-shot iterator is checked as it streams)."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        if not isinstance(items, Sequence | type({}.items())):
            return items, False
        items = list(items)
        # A trainer sends the same names / shapes / dtypes every step: checked once, then only
        # compared with the last set that passed (under the same manifest and FP8 settings).
        meta = tuple((n, tuple(t.shape), t.dtype) for n, t in items)
        key = (id(self.manifest), self.fp8, self.fp8_mode, self.require_complete, meta)
        if key != self._validated:
            self.validate(meta)
            self._validated = key
        return items, True

    def _stream_entry(self, name: str, t: torch.Tensor, checked: bool) -> WireEntry:
        """``t`` as it goes on the wire; checked against the manifest here unless ``checked``."""
        e = wire_entry(name, t.detach().to(self.device), self.fp8, self.fp8_mode)
        if not checked:
            for oname, oshape, odtype in e.outs:
                if (err := self.manifest.check(oname, oshape, odtype)) is not None:
                    raise ManifestMismatchError(f"refusing tensor mid-stream: {err}")
        return e

    def _bucket_limit(self, k: int) -> int:
        return bucket_limit(k, self.first_bucket_bytes, self.bucket_bytes)

    # -- sync: validate, then open / send / close, or fail ---------------------------------
    def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        version: str,
        *,
        quantize: bool = True,
    ) -> SyncReport:
        if self.group is None:
            raise WeightSyncError("not connected: call connect() first")
        if not quantize and self.fp8 is not None:
            if self.fp8_mode == "real":
                raise WeightSyncError(
                    "quantize=False: the servers hold real FP8 weights (fp8_mode='real') and cannot take "
                    "unquantized ones; only a fake-quant (bf16) server can"
                )
            # The FP8 scheme is part of the validation key and of every packing decision: this one
            # sync runs without it, and the synchronizer is back to quantizing afterwards.
            scheme, self.fp8 = self.fp8, None
            try:
                return self.sync(named_tensors, version)
            finally:
                self.fp8 = scheme
        t0 = time.perf_counter()
        items, checked = self._validated_input(named_tensors)
        u = _Update(version, checked, t0, {"validate": time.perf_counter() - t0})
        # The packer starts on bucket 0 now, overlapping the pause / begin round trips.
        entry = functools.partial(self._stream_entry, checked=checked)
        groups = functools.partial(group_entries, items, entry, self._bucket_limit)  # (stop) -> groups
        packer = BucketPacker(groups, self._send_buffers, self._fp8_ws)
        try:
            self._open_update(u)
            try:
                self._send_update(u, packer)
                self._close_update(u)
            except BaseException as e:
                raise self._fail_update(u, e) from e
            return self._resume_generation(u)
        finally:
            packer.shutdown()

    def _open_update(self, u: _Update) -> None:
        """Pause generation and open the servers' update session (``/begin_weight_update``)."""
        t = time.perf_counter()
        self._calls.all("pause_generation", self.pause_mode)
        self._dirty = True
        u.timings["pause"] = time.perf_counter() - t
        # No separate /flush_cache here: the last bucket's request flushes the radix cache after
        # loading (nothing generates while paused, so stale KV is never read in between). The HTTP
        # /flush_cache also runs a full gc.collect() of the server heap on CPU SGLang (its
        # empty_cache), ~0.5 s that has nothing to do with the cache; the request's flush skips it.
        t = time.perf_counter()
        self._begin()
        u.timings["begin"] = time.perf_counter() - t
        for k in ("quantize", "pack", "wire", "wait"):
            u.timings[k] = 0.0

    def _send_update(self, u: _Update, packer: BucketPacker) -> None:
        """Send every bucket the packer prepares, pipelined one deep (see :meth:`_await_joined`)."""
        u.t_send = time.perf_counter()
        buckets = packer.buckets()
        with contextlib.closing(buckets):
            while True:
                tw = time.perf_counter()
                item = next(buckets, None)
                # Preparation not hidden by a transfer: all of bucket 0's wait, and for later
                # ones the part after the servers had loaded everything sent before.
                ready = time.perf_counter()
                idle = u.inflight[-1].answered_at if u.inflight else tw
                u.timings["wait"] += max(0.0, ready - idle) if idle else 0.0
                if item is None:
                    break
                tw = time.perf_counter()
                # Pipelined one deep: this request waits in the servers while they load the
                # previous bucket, instead of after a round trip through the trainer.
                u.inflight.append(self._post_bucket(*item))
                if len(u.inflight) == 2:
                    u.n_bytes += self._finish_bucket(u.inflight.pop(0))
                self._await_joined(u.inflight[-1])
                # Its broadcast is complete, so its buffer is free: the packer fills it while
                # the servers load the bucket (the trainer's core is otherwise idle then).
                packer.release(u.inflight[-1].idx)
                u.timings["wire"] += time.perf_counter() - tw
                bucket = item[0]
                u.timings["quantize"] += bucket.seconds["fp8"]
                u.timings["pack"] += bucket.seconds["copy"]
                u.n_tensors += len(bucket.names)
                u.n_buckets += 1
                u.sent.update(bucket.names)

    def _close_update(self, u: _Update) -> None:
        """Check a streamed update was complete, close the session (``/end_weight_update``, once
        every bucket is loaded) and set the servers' weight version."""
        if not u.checked and self.require_complete:
            missing = set(self.manifest.tensors) - u.sent
            if missing:
                raise ManifestMismatchError(
                    f"stream ended without {len(missing)} served weights, e.g. {sorted(missing)[:5]}"
                )
        tw = time.perf_counter()
        end = None
        if u.inflight:
            # Pipelined like a bucket (the last one was joined above): /end_weight_update waits
            # in the servers behind it (the tokenizer manager serialises both on is_pause_cond).
            # If that bucket fails, the session is closed on partial weights: still paused, and
            # a retry opens a new one.
            end = self._calls.submit_all("end_weight_update")
        while u.inflight:
            u.n_bytes += self._finish_bucket(u.inflight[0])
            u.inflight.pop(0)
        u.timings["wire"] += time.perf_counter() - tw
        u.timings["buckets"] = time.perf_counter() - u.t_send
        t = time.perf_counter()
        if end is None:
            if self.pause_mode != "in_place":  # nothing sent (an empty partial update): drop stale KV
                self._calls.all("flush_cache")
            end = self._calls.submit_all("end_weight_update")
        try:
            ends = end.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError as e:
            raise WeightSyncTimeoutError(f"end_weight_update not answered after {self.timeout_s}s") from e
        for url, r in zip(self.urls, ends, strict=True):
            if not (isinstance(r, dict) and r.get("success")):
                raise WeightSyncError(f"{url} end_weight_update failed: {r}")
        self._calls.all("update_weight_version", u.version)
        u.timings["end_version"] = time.perf_counter() - t

    def _fail_update(self, u: _Update, error: BaseException) -> WeightSyncError:
        """The error an update that failed after its open raises: the servers stay paused, and it
        says how to recover (a timeout: through a new synchronizer; else: sync again)."""
        if isinstance(error, Exception):
            self._drain(u.inflight, error)
        timed_out = isinstance(error, TimeoutError)
        return (WeightSyncTimeoutError if timed_out else WeightSyncError)(
            f"weight update to {u.version!r} failed after {u.n_buckets} buckets: {error}\n"
            f"servers {self.urls} are left PAUSED (generation would run on partially updated weights); "
            + (
                "a server did not answer in time: close() this synchronizer and connect() a new "
                "one (a server that is merely slow may still act on what was sent), then sync again"
                if timed_out
                else "call sync() again with the full weights to recover"
            )
        )

    def _resume_generation(self, u: _Update) -> SyncReport:
        """The update is complete: its version is the servers', and they may generate again."""
        self.version = u.version
        self._dirty = False
        t = time.perf_counter()
        self._calls.all("continue_generation")
        u.timings["continue"] = time.perf_counter() - t
        report = SyncReport(
            u.version,
            u.n_tensors,
            u.n_bytes,
            u.n_buckets,
            time.perf_counter() - u.t0,
            self.fp8_label,
            u.timings,
        )
        log.info(
            "weight sync %s: %d tensors, %.1f MB, %d buckets, %.3fs (fp8=%s)",
            u.version,
            u.n_tensors,
            u.n_bytes / 1e6,
            u.n_buckets,
            report.seconds,
            report.fp8,
        )
        return report

    # -- one bucket ---------------------------------------------------------------------------
    def _post_bucket(self, bucket: Bucket, idx: int) -> _InFlight:
        """Send ``bucket``: one request per server and the broadcast they will join."""
        assert self.group is not None
        fut = self._calls.submit_all(
            "update_weights_from_distributed",
            bucket.names,
            bucket.dtypes,
            bucket.shapes,
            self.group_name,
            load_format="flattened_bucket",
            # The last bucket's request also resets the radix cache / KV pools once every weight
            # is in (see _open_update()); not under an in_place pause, whose requests keep their KV.
            flush_cache=bucket.last and self.pause_mode != "in_place",
        )
        work = broadcast_async(bucket.flat, self.group)
        f = _InFlight(bucket, idx, fut, work)
        fut.add_done_callback(lambda _: setattr(f, "answered_at", time.perf_counter()))
        return f

    def _await_joined(self, f: _InFlight) -> None:
        """Block until every server has joined ``f``'s broadcast (or one refused the bucket).

        A server handles update requests one at a time, in the order they arrive. A request sent
        while the previous one is still being transferred or loaded waits in the server instead of
        behind a round trip through the trainer; but only once every server has *joined* the previous
        broadcast (the trainer's side of a broadcast completes only then) is it certain that the
        previous request arrived first, so that no server pairs a bucket's bytes with another
        bucket's layout."""
        if self.backend != "gloo":
            # An NCCL root can finish a broadcast small enough for the peers' staging buffers before
            # they join it, so only their answer proves the order there: not pipelined.
            self._finish_bucket(f)
            return
        # gloo's root finishes a broadcast only once every receiver has joined it, whatever its size
        # (checked by tests/bridge/test_weight_sync.py). Polled: with a done-callback on the
        # broadcast's future instead, every transfer on the group was slower (the benchmark's raw
        # transfers: 0.16-0.18 s with it, 0.13 s without, in alternating runs).
        deadline = time.monotonic() + self.timeout_s
        while not (f.work.is_completed() or f.fut.done()):
            if time.monotonic() > deadline:
                raise WeightSyncTimeoutError(f"bucket not received after {self.timeout_s}s")
            time.sleep(0.0005)
        if not f.work.is_completed():
            # A server answered first: a refusal (it never joins), which this raises with the
            # server's answer; or the broadcast is a moment from being marked done.
            self._finish_bucket(f)
            return
        try:
            f.work.wait()  # completed: returns at once, or raises why the broadcast failed
        except Exception as e:
            # Completed by failing: the group's own timeout (also timeout_s) can end a broadcast a
            # server never joined before the deadline above does. Not joined, so nothing more is sent.
            if f.fut.done():
                self._finish_bucket(f)  # the servers' answers say why
            raise WeightSyncTimeoutError(f"bucket not received after {self.timeout_s}s ({e})") from e

    def _finish_bucket(self, f: _InFlight, timeout_s: float | None = None) -> int:
        """Wait (up to ``timeout_s``, default :attr:`timeout_s`) for every server to have loaded
        ``f``'s bucket; returns its bytes. Once only: a bucket already checked (by
        :meth:`_await_joined`) is not waited on or flushed again."""
        if f.loaded:
            return f.bucket.nbytes
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        # Wait on the servers' answers, never blindly on the broadcast: a server answers only after
        # it has received and loaded the bucket, or with an error if it refused it (then it never
        # joins the broadcast, which would wait forever).
        try:
            results = f.fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError as e:
            raise WeightSyncTimeoutError(f"bucket not loaded after {timeout_s:g}s") from e
        except Exception as e:
            raise WeightSyncError(
                f"a server failed the bucket: {e}; the update group is now unusable (reconnect)"
            ) from e
        loaded = [
            isinstance(r, dict) and (r.get("success") or _NOT_FLUSHED in r.get("message", ""))
            for r in results
        ]
        if all(loaded):
            f.work.wait(timeout=timedelta(seconds=max(timeout_s, 1.0)))  # done: all received it
        for url, c, r, ok in zip(self.urls, self._calls.clients, results, loaded, strict=True):
            if ok and not r.get("success"):
                # Loaded, but requests were still being retracted: flush on its own, with retries.
                self._calls.run(c.flush_cache())
            elif not (isinstance(r, dict) and r.get("success")):
                raise WeightSyncError(
                    f"{url} failed to load bucket {f.bucket.names[:3]}...: {r}; "
                    "the update group may be unusable (reconnect)"
                )
        f.loaded = True
        return f.bucket.nbytes

    def _drain(self, inflight: list[_InFlight], error: Exception) -> None:
        """After ``error``, let the buckets still on their way land, so that a retry's requests
        cannot overtake them; all of them share one :attr:`timeout_s`.

        Skipped after a timeout: a server that did not answer in time is not expected to answer the
        rest, and the recovery is a new group anyway (:class:`WeightSyncTimeoutError`)."""
        if isinstance(error, TimeoutError):
            return
        deadline = time.monotonic() + self.timeout_s
        for f in inflight:
            with contextlib.suppress(Exception):
                self._finish_bucket(f, max(0.0, deadline - time.monotonic()))

    def _begin(self) -> None:
        async def begin(c: SGLangClient) -> Any:
            try:
                return await c.begin_weight_update()
            except SGLangHTTPError as e:
                # A failed earlier update left its session open: ours continues it (retry path).
                if e.status == 400 and "already open" in e.body:
                    log.warning(
                        "%s: weight-update session still open from a failed update; reusing it", c.url
                    )
                    return {"success": True}
                raise

        async def go() -> list[Any]:
            return list(await asyncio.gather(*(begin(c) for c in self._calls.clients)))

        for url, r in zip(self.urls, self._calls.run(go()), strict=True):
            if not (isinstance(r, dict) and r.get("success")):
                raise WeightSyncError(f"{url} begin_weight_update failed: {r}")

    # -- verify ---------------------------------------------------------------------------
    def verify(
        self,
        prompts: Sequence[Sequence[int]],
        reference: ReferenceLogprobs,
        *,
        max_new_tokens: int = 8,
        temperature: float = 1.0,
    ) -> VerifyReport:
        """Generate on the first server and compare its per-token log-probs with ``reference``.

        ``reference(prompt_ids, output_ids, T)`` must return the trainer's log-probs of each output
        token at temperature ``T`` (the temperature the server's log-probs are at). Reports
        max / mean |delta logp| over all tokens (:func:`~sglang_bridge.weight_sync.verify.compare_logprobs`).
        """
        params = verify_params(max_new_tokens, temperature)
        groups = self._calls.run(self._calls.clients[0].generate([list(p) for p in prompts], params, n=1))
        return compare_logprobs([g[0] for g in groups], reference)
