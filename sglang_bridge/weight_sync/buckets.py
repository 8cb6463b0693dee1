"""What goes on the wire and how it is packed: wire entries (an input tensor as it is sent, FP8 step
included), buckets (one flat uint8 buffer in SGLang's ``flattened_bucket`` layout), their byte
budgets, and the packer thread that prepares the next bucket in one of two send buffers while the
other is on its way (double buffering).

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
from sglang_bridge.weight_sync.manifest import dtype_str

Fp8Mode = Literal["real", "fake"]

OutMeta = tuple[str, tuple[int, ...], torch.dtype]
"""(name, shape, dtype) of one tensor as it goes on the wire."""


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
    """Tensors packed into one flat uint8 buffer, largest itemsize first so every offset is aligned
    (SGLang's receiver rejects a tensor whose byte offset is not a multiple of its itemsize).

    ``items``: ``(name, tensor)`` pairs to copy, or :class:`WireEntry` whose ``fill`` writes its FP8
    result straight into the bucket (no intermediate tensor, no concatenation). ``seconds`` holds
    the time spent per entry kind ("copy" = packing, "fp8" = quantizing into place).
    """

    def __init__(
        self,
        items: Sequence[tuple[str, torch.Tensor] | WireEntry],
        buf: torch.Tensor,
        workspace: Fp8Workspace | None = None,
    ):
        entries = [it if isinstance(it, WireEntry) else copy_entry(*it) for it in items]
        slots = [(e, j) for e in entries for j in range(len(e.outs))]
        slots.sort(key=lambda s: -s[0].outs[s[1]][2].itemsize)  # stable: input order within a dtype
        self.names = [e.outs[j][0] for e, j in slots]
        self.dtypes = [dtype_str(e.outs[j][2]) for e, j in slots]
        self.shapes = [list(e.outs[j][1]) for e, j in slots]
        views: dict[int, list[torch.Tensor]] = {id(e): [torch.empty(0)] * len(e.outs) for e in entries}
        off = 0
        for e, j in slots:
            _, shape, dtype = e.outs[j]
            nb = math.prod(shape) * dtype.itemsize
            views[id(e)][j] = buf[off : off + nb].view(dtype).view(shape)
            off += nb
        self.flat = buf[:off]
        self.nbytes = off
        self.seconds = {"copy": 0.0, "fp8": 0.0}
        self.last = False
        """The update's last bucket: its request also flushes the servers' radix cache."""
        ws = workspace or Fp8Workspace()
        for e in entries:
            t0 = time.perf_counter()
            if e.fill is None:
                views[id(e)][0].copy_(e.tensor.reshape(e.outs[0][1]), non_blocking=True)
            else:
                e.fill(views[id(e)], ws)
            self.seconds[e.kind] += time.perf_counter() - t0


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
    last group. Stops early once ``stop`` is set."""
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
            self._bufs[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._bufs[i]


_DONE = object()


class BucketPacker:
    """Packed buckets, prepared ahead on a worker thread that starts at once (so bucket 0 is
    prepared while the servers pause and open the update).

    The worker pulls tensors through ``groups(stop)`` (running any lazy conversion of the caller's
    stream), FP8-quantizes and packs the next bucket straight into a free one of two send buffers
    while the other is being broadcast and loaded by the servers, so that work hides behind the
    transfer (torch ops release the GIL). :meth:`buckets` yields each bucket with the index of the
    send buffer it occupies, :meth:`release` hands a buffer back once its broadcast is complete, and
    :meth:`shutdown` stops the worker (idempotent; call it whether or not the buckets were used).
    """

    def __init__(
        self,
        groups: Callable[[threading.Event], Iterator[tuple[list[WireEntry], bool]]],
        buffers: SendBuffers,
        workspace: Fp8Workspace,
    ):
        self._free: queue.Queue[int] = queue.Queue()
        for i in (0, 1):
            self._free.put(i)
        self._ready: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._buffers = buffers
        self._workspace = workspace  # used by the (one) packing thread only
        self._worker = threading.Thread(
            target=self._work, args=(groups,), name="weight-sync-pack", daemon=True
        )
        self._worker.start()

    def _work(self, groups: Callable[[threading.Event], Iterator[tuple[list[WireEntry], bool]]]) -> None:
        try:
            for entries, last in groups(self._stop):
                idx = self._free.get()
                if self._stop.is_set():
                    return
                nbytes = sum(e.nbytes for e in entries)
                bucket = Bucket(entries, self._buffers.get(idx, nbytes), self._workspace)
                bucket.last = last
                self._ready.put((bucket, idx))
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
