"""A remote source of a weight sync with several sources (:class:`WeightSource`): a process that
holds part of the model (a trainer's pipeline stage, an expert-parallel rank's experts) and
broadcasts it to every server itself, on its own update group, while the coordinator
(:class:`~sglang_bridge.weight_sync.distributed.DistributedWeightSynchronizer`, source 0) runs the
update's lifecycle once for all of them.

Its side of one sync, over the :class:`~sglang_bridge.weight_sync.control.ControlStore`:

1. read the sync's settings; in a new generation of groups (a new coordinator), leave the old group,
   host a store for the new one, register it and join it (the coordinator has the servers join);
2. declare its tensors (names, shapes, dtypes), then wait for the coordinator's go: the union of
   every source's declaration passed the manifest, or the update is refused and nothing is sent;
3. pack its buckets (the layouts the coordinator planned from the same declaration) into two send
   buffers as the tensors stream in; for each, wait until the coordinator has posted its request,
   broadcast it, and say once every server has joined;
4. wait for the result of the whole update. A failure here is reported to the coordinator, which
   fails the update naming this source.

A source that fails while sending (its stream raises between buckets, a broadcast fails) says so,
then tears its update group down: the servers may already wait in its broadcast (the
coordinator posts a bucket's request before the source sends it), and SGLang's end of the group has
torch's default timeout (30 min; ``/init_weights_update_group`` takes none). With gloo, closing the
group closes its connections, so every server's receive fails at once ("Connection closed by
peer", answered as a failed bucket, the server alive), exactly as when the source's process dies;
the coordinator's update then fails naming this source, and a new synchronizer (a new generation of
groups) recovers. On NCCL (not measured) a receive is not expected to see its peer go: the
servers would wait for their group's timeout (docs/bridge.md).
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sglang_bridge.fp8 import Fp8Workspace
from sglang_bridge.weight_sync.buckets import (
    BucketPacker,
    SendBuffers,
    bucket_limit,
    planned_buckets,
    wire_entry,
    wire_meta,
)
from sglang_bridge.weight_sync.control import ControlStore
from sglang_bridge.weight_sync.interface import SyncReport, WeightSyncError, WeightSyncTimeoutError
from sglang_bridge.weight_sync.manifest import ManifestMismatchError
from sglang_bridge.weight_sync.plan import InputMeta, meta_to_json, plan_buckets, scheme_from_json
from sglang_bridge.weight_sync.update_group import broadcast_async, create_update_group, host_update_store

log = logging.getLogger(__name__)


class _Aborted(Exception):
    """The coordinator ended the update early (its result says why)."""


class WeightSource:
    """Source ``index`` (>= 1) of the coordinator on ``control``.

    Args:
        control: the coordinator's control store (:meth:`ControlStore.join` its address).
        index: this source's number, 1 .. sources - 1 (the coordinator is 0).
        label: how errors name it (e.g. ``stage 1 (EP rank 0, rank 2)``).
        address: where the servers reach this process (its group's store and broadcasts).
        port: its group's store port (None: a free one, picked at bind time).
        device: where its send buffers live (cuda: nccl, like the coordinator).
    """

    def __init__(
        self,
        control: ControlStore,
        index: int,
        *,
        label: str = "",
        address: str = "127.0.0.1",
        port: int | None = None,
        device: torch.device | str = "cpu",
    ):
        if index < 1:
            raise ValueError(f"index={index}: source 0 is the coordinator")
        self.control = control
        self.index = index
        self.label = label or f"source {index}"
        self.address = address
        self.port = port
        self.device = torch.device(device)
        self.group: dist.ProcessGroup | None = None
        self.gen = 0
        self.torn_down: tuple[int, int] | None = None
        """(generation, sync) of the group this source tore down after a failed send (None: none)."""
        self.seq: int | None = None
        """The last sync this source took part in (None: none yet)."""
        self._send_buffers = SendBuffers(self.device)
        self._fp8_ws = Fp8Workspace()

    # -- groups -----------------------------------------------------------------------------------
    def _join(self, info: dict[str, Any]) -> None:
        """Be in this generation's group: leave the old one, host, register and join the new one."""
        if self.group is not None and self.gen == info["gen"]:
            return
        if self.torn_down is not None and self.torn_down[0] == info["gen"]:
            # The servers still hold this generation's group, broken: a new one under its name
            # would wait for servers that never join it.
            raise WeightSyncError(
                f"{self.label}: its update group was torn down when weight sync {self.torn_down[1]} "
                "failed; close() the coordinator's synchronizer and connect() a new one (new update "
                "groups), then sync again"
            )
        self._leave()
        timeout = timedelta(seconds=float(info["timeout_s"]))
        world = int(info["world"])
        store = host_update_store(self.address, self.port or 0, world, timeout)
        name = f"{info['group_base']}_s{self.index}"
        reg = {"address": self.address, "port": store.port, "label": self.label, "nonce": uuid.uuid4().hex}
        self.control.put(f"reg/{info['gen']}/{self.index}", reg)
        self.group = create_update_group(
            info["backend"], self.address, store.port, world, 0, name, timeout, store=store
        )
        self.gen = int(info["gen"])
        log.info("%s: weight-update group %s ready (world %d)", self.label, name, world)

    def _leave(self) -> None:
        """Destroy this source's update group. The last reference goes with it (``group`` is local
        here): only then does torch destroy the backend, and gloo close its connections."""
        if self.group is not None:
            group, self.group = self.group, None
            try:
                dist.destroy_process_group(group)
            except Exception as e:  # noqa: BLE001 - a group the servers left is gone either way
                log.warning("%s: leaving the old update group: %s", self.label, e)
            del group

    def _tear_down(self, seq: int) -> None:
        """After a failed send of sync ``seq``: close the group, so that a server waiting in this
        source's broadcast fails its receive now rather than at its group's timeout."""
        if self.group is None:
            return
        t = time.perf_counter()
        self._leave()
        self.torn_down = (self.gen, seq)
        log.warning(
            "%s: weight sync %d failed while sending; update group torn down in %.2fs (the servers' "
            "receive fails now)",
            self.label,
            seq,
            time.perf_counter() - t,
        )

    def close(self) -> None:
        """Leave the update group (idempotent)."""
        self._leave()

    # -- one sync ---------------------------------------------------------------------------------
    def _next_seq(self) -> int:
        """The number of the sync to take part in: the one after the last, or for the first, the
        coordinator's current one if it is still waiting for the sources' declarations (a source
        that started after the coordinator), else the next."""
        if self.seq is not None:
            return self.seq + 1
        now = self.control.counter("seq")
        if now == 0:
            return 1
        # The coordinator counts a sync, then publishes it: wait for it rather than read a sync
        # counted but not yet published as one that is over (this source would then wait for the
        # next while the coordinator waits for it).
        info = self.control.get(f"sync/{now}", f"weight sync {now} from the coordinator")
        if "error" in info or self.control.poll(f"go/{now}") is not None:
            return now + 1  # refused, or past the declarations (it cannot be waiting for ours)
        return now

    def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        meta: Iterable[tuple[str, Sequence[int], torch.dtype]],
    ) -> SyncReport:
        """Take part in the coordinator's next sync with ``named_tensors``, which yields exactly
        ``meta`` (``(name, shape, dtype)`` in order); returns this source's part of the report.
        Raises what ended the update (:class:`ManifestMismatchError` if it was refused before
        anything was sent), naming the source that failed."""
        seq = self.seq = self._next_seq()
        t0 = time.perf_counter()
        info = self.control.get(f"sync/{seq}", f"weight sync {seq} from the coordinator")
        if "error" in info:
            raise WeightSyncError(f"the coordinator could not start weight sync {seq}: {info['error']}")
        timeout_s = float(info["timeout_s"])
        declared: list[InputMeta] = [(n, tuple(s), d) for n, s, d in meta]
        try:
            self._join(info)
            self.control.put(f"meta/{seq}/{self.index}", {"meta": meta_to_json(declared)})
        except BaseException as e:
            self.control.put(f"meta/{seq}/{self.index}", {"error": f"{type(e).__name__}: {e}"})
            raise
        go = self.control.get(f"go/{seq}", f"the coordinator's check of weight sync {seq}", timeout_s)
        if not go["ok"]:
            kind = ManifestMismatchError if "ManifestMismatchError" in go["error"] else WeightSyncError
            raise kind(f"weight update {info['version']!r} refused before anything was sent: {go['error']}")
        slots = list(go["slots"][str(self.index)])
        n_bytes = self._send(seq, info, named_tensors, declared, slots)
        result = self.control.get(f"result/{seq}", f"the end of weight sync {seq}", timeout_s)
        if not result["ok"]:
            raise WeightSyncError(f"weight update {info['version']!r} failed: {result['error']}")
        seconds = time.perf_counter() - t0
        fp8 = "none" if info["fp8"] is None else ("real" if info["fp8_mode"] == "real" else "fake-quant")
        return SyncReport(
            info["version"], len(declared), n_bytes, len(slots), seconds, fp8, {}, {self.label: n_bytes}
        )

    def _send(
        self,
        seq: int,
        info: dict[str, Any],
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        declared: list[InputMeta],
        slots: list[int],
    ) -> int:
        """Pack and broadcast this source's buckets at ``slots``; returns the bytes sent."""
        scheme, mode = scheme_from_json(info["fp8"]), info["fp8_mode"]
        limit = functools.partial(
            bucket_limit, first_bytes=int(info["first_bucket_bytes"]), max_bytes=int(info["bucket_bytes"])
        )
        layouts = plan_buckets(declared, lambda n, s, d: wire_meta(n, s, d, scheme, mode), limit)
        if len(layouts) != len(slots):
            raise WeightSyncError(
                f"{self.label}: planned {len(layouts)} buckets, the coordinator {len(slots)}"
            )

        def entry(name: str, t: torch.Tensor) -> Any:
            return wire_entry(name, t.detach().to(self.device), scheme, mode)

        packer = BucketPacker(
            planned_buckets(named_tensors, layouts, entry), self._send_buffers, self._fp8_ws
        )
        pending = list(slots)
        n_bytes = 0
        try:
            for (bucket, idx), r in zip(packer.buckets(), slots, strict=True):
                if (
                    self.control.get(
                        f"posted/{seq}/{r}", f"the request of bucket {r}", float(info["timeout_s"])
                    )
                    != "go"
                ):
                    raise _Aborted
                assert self.group is not None
                self._wait_sent(broadcast_async(bucket.flat, self.group), seq, float(info["timeout_s"]))
                self.control.put(f"joined/{seq}/{r}", {"ok": True})
                pending.remove(r)
                packer.release(idx)
                n_bytes += bucket.nbytes
        except _Aborted:
            return n_bytes  # the result says why
        except BaseException as e:
            why = f"{self.label}: {type(e).__name__}: {e}"
            for r in pending:  # the coordinator waits for one of these
                self.control.put(f"joined/{seq}/{r}", {"error": why})
            # Then torn down: the coordinator waits for the servers' answers to the requests it
            # already posted, and a server in this source's broadcast answers only once its receive
            # fails. Told first, so that the coordinator names why (not the server's lost peer).
            self._tear_down(seq)
            raise
        finally:
            packer.shutdown()
        return n_bytes

    def _wait_sent(self, work: dist.Work, seq: int, timeout_s: float) -> None:
        """Until every server has joined the broadcast (gloo's root completes only then), or the
        coordinator ended the update (a server refused the bucket: it never joins)."""
        deadline = time.monotonic() + timeout_s
        polls = 0
        while not work.is_completed():
            polls += 1
            if polls % 40 == 0 and self.control.poll(f"result/{seq}") is not None:
                raise _Aborted
            if time.monotonic() > deadline:
                raise WeightSyncTimeoutError(f"{self.label}: bucket not received after {timeout_s}s")
            time.sleep(0.0005)
        work.wait()  # completed: returns at once, or raises why the broadcast failed
