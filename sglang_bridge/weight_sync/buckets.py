"""What goes on the wire and how it is packed: wire entries (an input tensor as it is sent, FP8 step
included), buckets (one flat uint8 buffer in SGLang's ``flattened_bucket`` layout), their byte
budgets, and the packer thread that prepares the next bucket in one of two send buffers while the
other is on its way (double buffering): grouped as the stream goes, or into layouts planned from
the stream's declared metadata (:mod:`~sglang_bridge.weight_sync.plan`).

Flattened buckets carry every dtype as bytes, so FP8 crosses gloo, which cannot broadcast float8.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from sglang_bridge.fp8 import (
    FP8_DTYPE,
    Fp8Scheme,
    Fp8Workspace,
    fake_quantize,
    fake_quantize_block_into,
    quantize,
    quantize_block_into,
    should_quantize,
)
from sglang_bridge.weight_sync.interface import WeightSyncError
from sglang_bridge.weight_sync.manifest import dtype_str
from sglang_bridge.weight_sync.plan import BucketLayout, OutMeta, layout_of

Fp8Mode = Literal["real", "fake"]


class StreamMismatchError(WeightSyncError, ValueError):
    """A stream departed from the metadata it declared (which was checked against the manifest)."""


def wire_meta(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, scheme: Fp8Scheme | None, mode: Fp8Mode
) -> list[OutMeta]:
    """What will actually be sent for one input tensor (after the FP8 step): itself, or in ``real``
    mode for a weight ``scheme`` quantizes, its e4m3 copy and its fp32 scale."""
    if scheme is None or mode == "fake":
        return [(name, shape, dtype)]
    if not should_quantize(name, torch.empty(shape, device="meta", dtype=dtype), scheme):
        return [(name, shape, dtype)]
    if scheme.granularity == "block":
        bn, bk = scheme.block_size
        sshape: tuple[int, ...] = (-(-shape[0] // bn), -(-shape[1] // bk))
    elif scheme.granularity == "per_channel":
        sshape = (shape[0], 1)
    else:
        sshape = (1,)
    return [
        (name, shape, FP8_DTYPE),
        (name[: -len("weight")] + scheme.scale_suffix, sshape, torch.float32),
    ]


@dataclass
class WireEntry:
    """One input tensor and what it becomes on the wire: ``outs`` (one tensor, or an FP8 weight and
    its scale) and ``fill``, which writes them into their views of a send bucket."""

    name: str
    tensor: torch.Tensor
    outs: list[OutMeta]
    kind: Literal["copy", "fp8"] = "copy"
    fill: Callable[[list[torch.Tensor], Fp8Workspace], None] | None = None

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for _, s, d in self.outs)


def copy_entry(name: str, t: torch.Tensor) -> WireEntry:
    """``t`` sent as it is."""
    return WireEntry(name, t, [(name, tuple(t.shape), t.dtype)])


def wire_entry(name: str, t: torch.Tensor, scheme: Fp8Scheme | None, mode: Fp8Mode) -> WireEntry:
    """What ``t`` becomes on the wire (after the FP8 step) and how to write it into a bucket."""
    if scheme is None or not should_quantize(name, t, scheme):
        return copy_entry(name, t)
    outs = wire_meta(name, tuple(t.shape), t.dtype, scheme, mode)
    block = scheme.granularity == "block"

    def fake(views: list[torch.Tensor], ws: Fp8Workspace) -> None:
        if block:
            fake_quantize_block_into(t, views[0], scheme.block_size, ue8m0=scheme.ue8m0, workspace=ws)
        else:
            views[0].copy_(fake_quantize(t, scheme))

    def real(views: list[torch.Tensor], ws: Fp8Workspace) -> None:
        if block:
            quantize_block_into(t, views[0], views[1], scheme.block_size, ue8m0=scheme.ue8m0, workspace=ws)
        else:
            q, s = quantize(t, scheme)
            views[0].copy_(q)
            views[1].copy_(s)

    return WireEntry(name, t, outs, "fp8", fake if mode == "fake" else real)


class Bucket:
    """Tensors packed into one flat uint8 buffer in the order of their :class:`BucketLayout` (largest
    itemsize first, so every offset is aligned: SGLang's receiver rejects a tensor whose byte offset
    is not a multiple of its itemsize).

    ``Bucket(items, buf)`` lays out and packs ``items`` at once: ``(name, tensor)`` pairs to copy, or
    :class:`WireEntry` whose ``fill`` writes its FP8 result straight into the bucket (no intermediate
    tensor, no concatenation). :meth:`planned` makes an empty bucket of a precomputed layout, which
    :meth:`fill` then fills input by input as the tensors stream in. ``seconds`` holds the time spent
    per entry kind ("copy" = packing, "fp8" = quantizing into place).
    """

    def __init__(
        self,
        items: Sequence[tuple[str, torch.Tensor] | WireEntry],
        buf: torch.Tensor,
        workspace: Fp8Workspace | None = None,
    ):
        entries = [it if isinstance(it, WireEntry) else copy_entry(*it) for it in items]
        metas = [((e.name, tuple(e.tensor.shape), e.tensor.dtype), e.outs) for e in entries]
        self._setup(layout_of(metas), buf)
        ws = workspace or Fp8Workspace()
        for i, e in enumerate(entries):
            self.fill(i, e, ws)

    @classmethod
    def planned(cls, layout: BucketLayout, buf: torch.Tensor) -> Bucket:
        """An empty bucket of ``layout`` in ``buf`` (at least ``layout.nbytes`` long)."""
        bucket = cls.__new__(cls)
        bucket._setup(layout, buf)
        return bucket

    def _setup(self, layout: BucketLayout, buf: torch.Tensor) -> None:
        self.layout = layout
        self.names = layout.names
        self.dtypes = layout.dtypes
        self.shapes = layout.shapes
        self._views = [
            buf[off : off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for _, shape, dtype, off in layout.slots
        ]
        self.flat = buf[: layout.nbytes]
        self.nbytes = layout.nbytes
        self.seconds = {"copy": 0.0, "fp8": 0.0}
        self.last = False
        """The update's last bucket: its request also flushes the servers' radix cache."""

    def fill(self, i: int, entry: WireEntry, workspace: Fp8Workspace) -> None:
        """Write input ``i`` of the layout (``entry``, whose wire tensors must be the layout's)."""
        views = [self._views[k] for k in self.layout.outs[i]]
        t0 = time.perf_counter()
        if entry.fill is None:
            views[0].copy_(entry.tensor.reshape(entry.outs[0][1]), non_blocking=True)
        else:
            entry.fill(views, workspace)
        self.seconds[entry.kind] += time.perf_counter() - t0


def bucket_limit(k: int, first_bytes: int, max_bytes: int) -> int:
    """Byte budget of bucket ``k``: ``first_bytes`` doubling up to ``max_bytes``.

    Only the first bucket's preparation (FP8, packing) cannot hide behind a transfer, so it is
    small enough to be ready when ``/begin_weight_update`` returns (32 MiB: ~10-20 ms of C
    fake-quant on one core); later buckets grow to keep the number of requests low (each costs
    the server a fixed ~10-40 ms on 2 loaded CPU cores: measured, 5 requests instead of 1 for
    the same bytes cost ~30% more)."""
    return min(max_bytes, first_bytes << min(k, 40))


def group_entries(
    tensors: Iterable[tuple[str, torch.Tensor]],
    entry: Callable[[str, torch.Tensor], WireEntry],
    limit: Callable[[int], int],
    stop: threading.Event,
) -> Iterator[tuple[list[WireEntry], bool]]:
    """Consecutive tensors as ``entry`` puts them on the wire, grouped by their bytes up to
    ``limit(k)`` for group ``k`` (a larger tensor gets its own group), each with whether it is the
    last group. Stops early once ``stop`` is set. A group's tensors are held until it is complete
    (its layout depends on all of them): the path of a stream whose metadata is not known ahead."""
    cur: list[WireEntry] = []
    size = 0
    k = 0
    for name, t in tensors:
        if stop.is_set():
            return
        e = entry(name, t)
        nb = e.nbytes
        if cur and size + nb > limit(k):
            yield cur, False
            cur, size, k = [], 0, k + 1
        cur.append(e)
        size += nb
    if cur:
        yield cur, True


class SendBuffers:
    """Reusable flat uint8 send buffers on ``device``, grow-only, so steady-state syncs allocate nothing."""

    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: list[torch.Tensor] = []

    def get(self, i: int, nbytes: int) -> torch.Tensor:
        """Send buffer ``i``, at least ``nbytes`` long (contents undefined)."""
        while len(self._bufs) <= i:
            self._bufs.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._bufs[i].numel() < nbytes:
            self._bufs[i] = torch.empty(0, dtype=torch.uint8, device=self.device)  # free it first
            self._bufs[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._bufs[i]

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold."""
        return sum(b.numel() for b in self._bufs)


_DONE = object()

Produce = Callable[["BucketPacker"], Iterator[tuple["Bucket", int]]]
"""What a packer's worker runs: packed buckets with their send buffer's index, each buffer taken with
:meth:`BucketPacker.acquire`."""


class BucketPacker:
    """Packed buckets, prepared ahead on a worker thread that starts at once (so bucket 0 is
    prepared while the servers pause and open the update).

    The worker runs ``produce`` (:func:`grouped_buckets` or :func:`planned_buckets`), which pulls the
    caller's tensors (running any lazy conversion of the stream, collectives included), FP8-quantizes
    and packs the next bucket straight into a free one of two send buffers while the other is being
    broadcast and loaded by the servers, so that work hides behind the transfer (torch ops release
    the GIL). :meth:`buckets` yields each bucket with the index of the send buffer it occupies,
    :meth:`release` hands a buffer back once its broadcast is complete, and :meth:`shutdown` stops
    the worker (idempotent; call it whether or not the buckets were used).
    """

    def __init__(self, produce: Produce, buffers: SendBuffers, workspace: Fp8Workspace):
        self._free: queue.Queue[int] = queue.Queue()
        for i in (0, 1):
            self._free.put(i)
        self._ready: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._buffers = buffers
        self.workspace = workspace  # used by the (one) packing thread only
        self._worker = threading.Thread(
            target=self._work, args=(produce,), name="weight-sync-pack", daemon=True
        )
        self._worker.start()

    @property
    def stop(self) -> threading.Event:
        """Set once the packer is shut down; a producer checks it between tensors."""
        return self._stop

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, int] | None:
        """A free send buffer of at least ``nbytes`` and its index (worker thread; blocks until one is
        released); None once the packer is shut down."""
        idx = self._free.get()
        if self._stop.is_set():
            return None
        return self._buffers.get(idx, nbytes), idx

    def _work(self, produce: Produce) -> None:
        try:
            for item in produce(self):
                self._ready.put(item)
            self._ready.put(_DONE)
        except BaseException as e:  # forwarded to the sending thread
            self._ready.put(e)

    def buckets(self) -> Iterator[tuple[Bucket, int]]:
        """The packed buckets in order, each with its send buffer's index; a packing error (e.g. a
        tensor refused mid-stream) is raised here, in the sending thread."""
        try:
            while (item := self._ready.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.shutdown()

    def release(self, idx: int) -> None:
        """Hand send buffer ``idx`` back to the packer (its broadcast is complete)."""
        self._free.put(idx)

    def shutdown(self) -> None:
        self._stop.set()
        self._free.put(0)  # unblock a worker waiting for a buffer
        while self._worker.is_alive():
            with contextlib.suppress(queue.Empty):
                self._ready.get(timeout=0.05)  # unblock a worker waiting to hand over
        self._worker.join()


def grouped_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    entry: Callable[[str, torch.Tensor], WireEntry],
    limit: Callable[[int], int],
) -> Produce:
    """Buckets grouped as the stream goes (:func:`group_entries`), for a stream of unknown metadata."""

    def produce(p: BucketPacker) -> Iterator[tuple[Bucket, int]]:
        for entries, last in group_entries(tensors, entry, limit, p.stop):
            got = p.acquire(sum(e.nbytes for e in entries))
            if got is None:
                return
            bucket = Bucket(entries, got[0], p.workspace)
            bucket.last = last
            yield bucket, got[1]

    return produce


def planned_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    layouts: Sequence[BucketLayout],
    entry: Callable[[str, torch.Tensor], WireEntry],
) -> Produce:
    """Buckets of precomputed ``layouts`` (:func:`~sglang_bridge.weight_sync.plan.plan_buckets`), each
    tensor written into its place as it streams in: besides the two send buffers only the tensor in
    hand is held. The stream must be exactly the layouts' inputs, in order (``StreamMismatchError``
    naming the first difference otherwise: a tensor it did not declare, one it left out, another
    shape or dtype)."""

    def produce(p: BucketPacker) -> Iterator[tuple[Bucket, int]]:
        it = iter(tensors)
        for k, layout in enumerate(layouts):
            got = p.acquire(layout.nbytes)
            if got is None:
                return
            bucket = Bucket.planned(layout, got[0])
            bucket.last = k == len(layouts) - 1
            for i, (name, shape, dtype) in enumerate(layout.inputs):
                item = next(it, None)
                if item is None:
                    raise StreamMismatchError(f"stream ended before {name}, which it declared")
                n, t = item
                if (n, tuple(t.shape), t.dtype) != (name, shape, dtype):
                    raise StreamMismatchError(
                        f"stream sent {n} {tuple(t.shape)} {dtype_str(t.dtype)} where it declared "
                        f"{name} {shape} {dtype_str(dtype)}"
                    )
                bucket.fill(i, entry(n, t), p.workspace)
                del item, t  # hold nothing but the buffers between tensors
                if p.stop.is_set():
                    return
            yield bucket, got[1]
        extra = next(it, None)
        if extra is not None:
            raise StreamMismatchError(f"stream sent {extra[0]} after every tensor it declared")

    return produce
