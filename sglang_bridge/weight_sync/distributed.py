"""The torch.distributed broadcast transport (gloo on CPU, NCCL on GPU):
:class:`DistributedWeightSynchronizer`, through SGLang's ``/update_weights_from_distributed``.

One update (:meth:`DistributedWeightSynchronizer.sync`), one lifecycle, coordinated here once
(:mod:`~sglang_bridge.weight_sync.lifecycle`) whatever the number of sources:

1. validate every (name, shape, dtype) that will be sent against the served model's
   :class:`~sglang_bridge.weight_sync.manifest.Manifest`. Declared metadata (``meta``, or a dict /
   list) is checked completely before anything touches a server -- with several sources, the
   union of what every source declared, each problem naming its source; a one-shot iterator
   without ``meta`` is checked tensor by tensor before its bucket is sent;
2. open: pause generation -> ``/begin_weight_update`` (the radix cache is flushed by the last
   bucket's request);
3. send: bucketed broadcasts, each bucket one ``/update_weights_from_distributed`` request in
   ``flattened_bucket`` format (:mod:`~sglang_bridge.weight_sync.buckets`) plus one broadcast,
   pipelined one deep on gloo (:mod:`~sglang_bridge.weight_sync.inflight`). With several sources
   (``sources > 1``: one per pipeline stage and expert-parallel rank of a trainer), each source
   broadcasts its own buckets on its own update group (:mod:`~sglang_bridge.weight_sync.source`);
   this coordinator, source 0, posts every bucket's request in one order for all servers
   (:func:`~sglang_bridge.weight_sync.plan.interleave`) and the sources say when their broadcast was
   joined, over a :class:`~sglang_bridge.weight_sync.control.ControlStore`;
4. close: ``/end_weight_update`` (SGLang's post-load processing) -> ``/update_weight_version`` ->
   continue.

The version is advanced only after ``end_weight_update`` succeeded. If anything fails after the open
the update fails: the servers stay *paused* (never generating on half-updated weights) and
:class:`WeightSyncError` says so and names the source; calling ``sync`` again with a full set of
weights is safe and resumes generation (after a :class:`WeightSyncTimeoutError`, or a failure of an
update with several sources, through a new synchronizer).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from sglang_bridge.client import PauseMode
from sglang_bridge.fp8 import Fp8Scheme, Fp8Workspace
from sglang_bridge.weight_sync.buckets import (
    Bucket,
    BucketPacker,
    SendBuffers,
    StreamMismatchError,
    WireEntry,
    bucket_limit,
    grouped_buckets,
    planned_buckets,
    wire_entry,
    wire_meta,
)
from sglang_bridge.weight_sync.control import ControlStore
from sglang_bridge.weight_sync.inflight import InFlight
from sglang_bridge.weight_sync.interface import (
    ReferenceLogprobs,
    SyncReport,
    VerifyReport,
    WeightSyncError,
    WeightSynchronizer,
)
from sglang_bridge.weight_sync.lifecycle import Update, UpdateLifecycle
from sglang_bridge.weight_sync.manifest import Manifest, ManifestMismatchError
from sglang_bridge.weight_sync.plan import BucketLayout, InputMeta, interleave, plan_buckets, scheme_to_json
from sglang_bridge.weight_sync.remote import RemoteSources
from sglang_bridge.weight_sync.server_calls import ServerCalls
from sglang_bridge.weight_sync.update_group import create_update_group, host_update_store
from sglang_bridge.weight_sync.verify import compare_logprobs, verify_params

log = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


class DistributedWeightSynchronizer(UpdateLifecycle, WeightSynchronizer):
    """Weight sync through ``/update_weights_from_distributed`` to one or many SGLang servers.

    The trainer is rank 0 of a group with every server's TP ranks (``world = 1 + sum(server_tp)``):
    one broadcast reaches all servers. gloo on CPU, nccl when ``device`` is CUDA; the code path is
    the same. Public methods are blocking and thread-safe to call from a driver loop; HTTP runs on a
    private event loop thread (:class:`ServerCalls`) so they can also be called while other event
    loops run.

    ``fp8``: None sends tensors as given; with a scheme, quantizable weights are FP8-quantized on the
    way ("real": e4m3 + scales, for an FP8 server) or fake-quantized ("fake": FP8-rounded values in
    the original dtype, for a bf16 CPU server; reported as ``fp8="fake-quant"``).

    ``sources > 1``: this synchronizer is source 0 (``source_label`` names it) and coordinates the
    other ``sources - 1`` :class:`~sglang_bridge.weight_sync.source.WeightSource` s, which joined
    ``control``. Each has its own update group with every server (SGLang receives only from group
    rank 0), formed at its first sync after this synchronizer connected; every server's TP rank is
    then in ``sources`` groups, each of ``1 + sum(server_tp)`` ranks, at the same rank offset.
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
        sources: int = 1,
        control: ControlStore | None = None,
        source_label: str = "",
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
        if sources < 1 or (sources > 1 and control is None):
            raise ValueError(f"sources={sources}: give at least 1, and a control store for more than 1")
        self.sources = sources
        self.control = control
        self.source_label = source_label or ("source 0" if sources > 1 else "")
        self._remote: RemoteSources | None = None
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
        if self.sources > 1:
            assert self.control is not None
            # A new generation of groups: the remote sources join it at their next sync.
            self._remote = RemoteSources(
                self.control,
                self.sources,
                self._calls,
                group_base=self.group_name,
                world=world,
                offsets=offsets,
                backend=self.backend,
                timeout_s=self.timeout_s,
            )
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
                if self._remote is not None:
                    self._remote.destroy()
            except Exception as e:  # a dead server must not block the trainer's shutdown
                log.warning("destroy_weights_update_group failed: %s", e)
            try:
                dist.destroy_process_group(self.group)
            except ValueError as e:  # already gone: the process destroyed every group (WORLD) first
                log.warning("the weight-update group was already destroyed: %s", e)
            self.group = None
        self._calls.close()

    # -- validation -----------------------------------------------------------------------
    def _wire(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list:
        return wire_meta(name, shape, dtype, self.fp8, self.fp8_mode)

    def validate(self, meta: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> None:
        """Raise :class:`ManifestMismatchError` listing every input tensor that would not match."""
        outs = (o for n, s, d in meta for o in self._wire(n, tuple(s), d))
        self.manifest.validate(outs, require_complete=self.require_complete)

    def _validate_cached(self, meta: Sequence[InputMeta]) -> None:
        """:meth:`validate`, skipped for the same names / shapes / dtypes as the last set that passed
        (a trainer sends the same every step) under the same manifest and FP8 settings."""
        key = (id(self.manifest), self.fp8, self.fp8_mode, self.require_complete, tuple(meta))
        if key != self._validated:
            self.validate(meta)
            self._validated = key

    def _validated_input(
        self, named_tensors: NamedTensors
    ) -> tuple[Iterable[tuple[str, torch.Tensor]], bool]:
        """The input as ``(name, tensor)`` pairs, and whether it was validated whole (a dict / list:
        checked before anything touches a server; a one-shot iterator is checked as it streams)."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        if not isinstance(items, Sequence | type({}.items())):
            return items, False
        items = list(items)
        self._validate_cached([(n, tuple(t.shape), t.dtype) for n, t in items])
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

    def _plan(self, meta: Iterable[InputMeta]) -> list[BucketLayout]:
        return plan_buckets(meta, self._wire, self._bucket_limit)

    # -- sync: validate, then open / send / close, or fail ---------------------------------
    def sync(
        self,
        named_tensors: NamedTensors,
        version: str,
        *,
        quantize: bool = True,
        meta: Iterable[tuple[str, Sequence[int], torch.dtype]] | None = None,
    ) -> SyncReport:
        """See :meth:`WeightSynchronizer.sync`. ``meta``: the ``(name, shape, dtype)`` of every
        tensor ``named_tensors`` will yield, in order (a trainer knows them before gathering
        anything): checked whole before any server is touched, and each tensor is then written into
        its place in a send buffer as it streams (besides the two buffers only the tensor in hand is
        held). Needed with several sources unless ``named_tensors`` is a dict / list."""
        try:
            if self.group is None:
                raise WeightSyncError("not connected: call connect() first")
            if not quantize and self.fp8 is not None:
                if self.fp8_mode == "real":
                    raise WeightSyncError(
                        "quantize=False: the servers hold real FP8 weights (fp8_mode='real') and cannot "
                        "take unquantized ones; only a fake-quant (bf16) server can"
                    )
        except WeightSyncError as e:
            if self.control is not None and self.sources > 1:
                RemoteSources.refuse(self.control, str(e))  # the sources wait for this sync
            raise
        if not quantize and self.fp8 is not None:
            # The FP8 scheme is part of the validation key and of every packing decision: this one
            # sync runs without it, and the synchronizer is back to quantizing afterwards.
            scheme, self.fp8 = self.fp8, None
            try:
                return self.sync(named_tensors, version, meta=meta)
            finally:
                self.fp8 = scheme
        if self._remote is not None:
            return self._sync_sources(named_tensors, version, meta)
        t0 = time.perf_counter()
        if meta is not None:
            declared = [(n, tuple(s), d) for n, s, d in meta]
            self._validate_cached(declared)
            entry = functools.partial(self._stream_entry, checked=True)
            produce = planned_buckets(named_tensors_items(named_tensors), self._plan(declared), entry)
            checked = True
        else:
            items, checked = self._validated_input(named_tensors)
            entry = functools.partial(self._stream_entry, checked=checked)
            produce = grouped_buckets(items, entry, self._bucket_limit)
        u = Update(version, checked, t0, {"validate": time.perf_counter() - t0})
        # The packer starts on bucket 0 now, overlapping the pause / begin round trips.
        packer = BucketPacker(produce, self._send_buffers, self._fp8_ws)
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

    def _send_update(self, u: Update, packer: BucketPacker) -> None:
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
                self._account(u, item[0], item[0].layout.inputs, "")

    @staticmethod
    def _account(u: Update, bucket: Bucket | BucketLayout, inputs: Sequence[Any], source: str) -> None:
        if isinstance(bucket, Bucket):
            u.timings["quantize"] += bucket.seconds["fp8"]
            u.timings["pack"] += bucket.seconds["copy"]
        u.n_tensors += len(inputs)
        u.n_buckets += 1
        u.sent.update(bucket.names)
        if source:
            u.source_bytes[source] = u.source_bytes.get(source, 0) + bucket.nbytes

    # -- several sources ------------------------------------------------------------------
    def _settings(self, version: str) -> dict[str, Any]:
        """What a remote source needs to pack exactly as this coordinator plans (JSON)."""
        return {
            "version": version,
            "fp8": scheme_to_json(self.fp8),
            "fp8_mode": self.fp8_mode,
            "bucket_bytes": self.bucket_bytes,
            "first_bucket_bytes": self.first_bucket_bytes,
            "backend": self.backend,
            "timeout_s": self.timeout_s,
        }

    def _sync_sources(self, named_tensors: NamedTensors, version: str, meta: Iterable | None) -> SyncReport:
        """One update from every source: their declared tensors checked together before anything
        is sent, then every source's buckets in one order, then close, or fail naming the source."""
        remote = self._remote
        assert remote is not None
        t0 = time.perf_counter()
        seq = remote.start(self._settings(version))
        try:
            remote.connect_pending()  # a source new in this generation joins its group first
            own = declared_meta(named_tensors, meta)
            layouts = {0: self._plan(own), **{s: self._plan(m) for s, m in remote.metas(seq).items()}}
            labels = {0: self.source_label, **remote.labels}
            outs = {labels[s]: [o for b in ls for o in b.slots] for s, ls in layouts.items()}
            self.manifest.validate_sources(
                {k: [(n, sh, d) for n, sh, d, _ in v] for k, v in outs.items()},
                require_complete=self.require_complete,
            )
            order = interleave({s: len(ls) for s, ls in layouts.items()})
        except BaseException as e:
            remote.go(seq, error=f"{type(e).__name__}: {e}")
            raise
        remote.go(seq, slots={s: [r for r, (s2, _) in enumerate(order) if s2 == s] for s in layouts if s})
        u = Update(version, True, t0, {"validate": time.perf_counter() - t0}, reconnect=True)
        entry = functools.partial(self._stream_entry, checked=True)
        packer = BucketPacker(
            planned_buckets(named_tensors_items(named_tensors), layouts[0], entry),
            self._send_buffers,
            self._fp8_ws,
        )
        posted = 0
        try:
            self._open_update(u)
            try:
                posted = self._send_slots(u, seq, order, layouts, packer)
                self._close_update(u)
            except BaseException as e:
                raise self._fail_update(u, e) from e
            report = self._resume_generation(u)
        except BaseException as e:
            unposted = [r for r in range(posted, len(order)) if order[r][0]]
            remote.finish(seq, error=f"{type(e).__name__}: {e}", unposted=unposted)
            raise
        finally:
            packer.shutdown()
        remote.finish(seq)
        return report

    def _send_slots(
        self,
        u: Update,
        seq: int,
        order: Sequence[tuple[int, int]],
        layouts: Mapping[int, Sequence[BucketLayout]],
        packer: BucketPacker,
    ) -> int:
        """Every source's buckets in ``order``, pipelined one deep like :meth:`_send_update`: this
        synchronizer's own from its packer, a remote source's by posting its request and waiting for
        the source to say every server joined its broadcast. Returns the slots posted."""
        assert self._remote is not None
        u.t_send = time.perf_counter()
        local: Iterator[tuple[Bucket, int]] = packer.buckets()
        posted = 0
        with contextlib.closing(local):
            for r, (s, k) in enumerate(order):
                tw = time.perf_counter()
                last = r == len(order) - 1
                if s == 0:
                    try:
                        bucket, idx = next(local)
                    except StreamMismatchError as e:
                        raise StreamMismatchError(f"{self.source_label}: {e}") from e
                    bucket.last = last
                    f = self._post_bucket(bucket, idx)
                    f.source, f.slot = self.source_label, r
                else:
                    f = self._remote.post(seq, s, r, layouts[s][k], last and self.pause_mode != "in_place")
                posted = r + 1
                u.inflight.append(f)
                if len(u.inflight) == 2:
                    u.n_bytes += self._finish_bucket(u.inflight.pop(0))
                self._await_joined(f)
                if s == 0:
                    packer.release(f.idx)
                u.timings["wire"] += time.perf_counter() - tw
                self._account(u, f.bucket, layouts[s][k].inputs, f.source)
        return posted

    def _await_remote(self, f: InFlight) -> None:
        assert self._remote is not None
        self._remote.await_joined(self._remote.seq, f, self._finish_bucket)

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


def named_tensors_items(named_tensors: NamedTensors) -> Iterable[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of a mapping or an iterable of pairs."""
    return named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors


def declared_meta(named_tensors: NamedTensors, meta: Iterable | None) -> list[InputMeta]:
    """``meta`` as a list, or the metadata of a dict / list of tensors; a one-shot stream must
    declare its tensors up front (``meta``) when several sources send together."""
    if meta is not None:
        return [(n, tuple(s), d) for n, s, d in meta]
    items = named_tensors_items(named_tensors)
    if not isinstance(items, Sequence | type({}.items())):
        raise WeightSyncError(
            "a sync with several sources checks every source's tensors before anything is sent: pass "
            "meta=[(name, shape, dtype), ...] with a one-shot stream"
        )
    return [(n, tuple(t.shape), t.dtype) for n, t in items]
