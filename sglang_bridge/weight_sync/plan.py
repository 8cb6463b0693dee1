"""Bucket layouts from metadata alone: what each bucket of a source holds, where every tensor sits in
it, and the order in which the buckets of several sources go to the servers.

A layout is a pure function of the source's ``(name, shape, dtype)`` list, the FP8 settings and the
bucket budgets, so the coordinator computes every source's layouts from the metadata the sources
declare (no tensor gathered yet), checks them against the manifest before any server is touched,
and posts each bucket's request; the source computes the same layouts and writes each tensor into
its place in a send buffer as it streams, so it never holds more than the tensor in hand besides
its two buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from sglang_bridge.fp8 import Fp8Scheme
from sglang_bridge.weight_sync.manifest import dtype_str

InputMeta = tuple[str, tuple[int, ...], torch.dtype]
"""(name, shape, dtype) of one tensor a source will stream, before the FP8 step."""

OutMeta = tuple[str, tuple[int, ...], torch.dtype]
"""(name, shape, dtype) of one tensor as it goes on the wire."""

Limit = Callable[[int], int]
"""Byte budget of bucket ``k``."""


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: its input tensors in stream order and where their wire tensors sit.

    ``inputs[i]`` is the i-th input's (name, shape, dtype); ``slots`` are the wire tensors, largest
    itemsize first (SGLang's receiver needs every offset to be a multiple of the itemsize), each
    ``(name, shape, dtype, byte offset)``; ``outs[i]`` indexes the slots of input ``i`` (one, or an
    FP8 weight and its scale)."""

    inputs: tuple[InputMeta, ...]
    slots: tuple[tuple[str, tuple[int, ...], torch.dtype, int], ...]
    outs: tuple[tuple[int, ...], ...]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [s[0] for s in self.slots]

    @property
    def dtypes(self) -> list[str]:
        return [dtype_str(s[2]) for s in self.slots]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(s[1]) for s in self.slots]


def layout_of(entries: Sequence[tuple[InputMeta, Sequence[OutMeta]]]) -> BucketLayout:
    """The layout of a bucket holding ``entries`` (each input and its wire tensors), in that order."""
    flat = [(i, j, out) for i, (_, outs) in enumerate(entries) for j, out in enumerate(outs)]
    flat.sort(key=lambda s: -s[2][2].itemsize)  # stable: input order within a dtype
    slots = []
    where: list[list[int]] = [[0] * len(outs) for _, outs in entries]
    off = 0
    for k, (i, j, (name, shape, dtype)) in enumerate(flat):
        slots.append((name, tuple(shape), dtype, off))
        where[i][j] = k
        off += math.prod(shape) * dtype.itemsize
    return BucketLayout(tuple(m for m, _ in entries), tuple(slots), tuple(map(tuple, where)), off)


def plan_buckets(
    meta: Iterable[InputMeta],
    wire: Callable[[str, tuple[int, ...], torch.dtype], list[OutMeta]],
    limit: Limit,
) -> list[BucketLayout]:
    """Consecutive inputs grouped by their wire bytes up to ``limit(k)`` for bucket ``k`` (a larger
    tensor gets a bucket of its own); ``wire`` says what one input becomes on the wire. The same
    grouping as the streaming packer's (:func:`~sglang_bridge.weight_sync.buckets.group_entries`)."""
    layouts: list[BucketLayout] = []
    cur: list[tuple[InputMeta, list[OutMeta]]] = []
    size = 0
    for name, shape, dtype in meta:
        outs = wire(name, tuple(shape), dtype)
        nb = sum(math.prod(s) * d.itemsize for _, s, d in outs)
        if cur and size + nb > limit(len(layouts)):
            layouts.append(layout_of(cur))
            cur, size = [], 0
        cur.append(((name, tuple(shape), dtype), outs))
        size += nb
    if cur:
        layouts.append(layout_of(cur))
    return layouts


def interleave(counts: Mapping[int, int]) -> list[tuple[int, int]]:
    """The order in which the buckets of several sources go to the servers: ``(source, bucket)``,
    round robin over the sources that still have buckets (``counts``: buckets per source).

    Every server receives the requests in this one order. A server loads one bucket request at a
    time, so two servers taking buckets of two sources in opposite orders would each wait in a
    broadcast the other has not joined; one order for all rules that out. Round robin lets each
    source prepare its next bucket while the others' are on the wire."""
    order = []
    for k in range(max(counts.values(), default=0)):
        order += [(s, k) for s in sorted(counts) if k < counts[s]]
    return order


def meta_to_json(meta: Iterable[InputMeta]) -> list[list]:
    """``meta`` as JSON values (the control channel carries JSON, never pickles)."""
    return [[n, list(s), dtype_str(d)] for n, s, d in meta]


def meta_from_json(data: Iterable[Sequence]) -> list[InputMeta]:
    """Inverse of :func:`meta_to_json`; an unknown dtype name raises ValueError."""
    out = []
    for name, shape, dtype in data:
        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"{name}: unknown dtype {dtype!r}")
        out.append((str(name), tuple(int(x) for x in shape), dt))
    return out


def scheme_to_json(scheme: Fp8Scheme | None) -> dict | None:
    """An FP8 scheme as JSON (None stays None)."""
    if scheme is None:
        return None
    return {
        "granularity": scheme.granularity,
        "block_size": list(scheme.block_size),
        "ue8m0": scheme.ue8m0,
        "ignored": list(scheme.ignored),
    }


def scheme_from_json(data: Mapping | None) -> Fp8Scheme | None:
    """Inverse of :func:`scheme_to_json`."""
    if data is None:
        return None
    return Fp8Scheme(
        granularity=data["granularity"],
        block_size=tuple(data["block_size"]),  # type: ignore[arg-type]
        ue8m0=bool(data["ue8m0"]),
        ignored=tuple(data["ignored"]),
    )
