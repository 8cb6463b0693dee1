"""The coordinator's side of its remote sources (every source but its own, index 0): their update
groups with the servers, what they declare, and the signals of one sync (see
:mod:`~sglang_bridge.weight_sync.control` for the keys, :mod:`~sglang_bridge.weight_sync.source`
for the other end).

Each source has its own update group with every server's TP ranks: SGLang 0.5.23 receives a
broadcast only from group rank 0 (``src=0``), so a group has one sender (docs/bridge.md). A group
is formed when its source first syncs in this generation, one group at a time: two servers
joining two groups in opposite orders would each wait in a rendezvous the other has not reached.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sglang_bridge.weight_sync.control import ControlStore
from sglang_bridge.weight_sync.inflight import InFlight
from sglang_bridge.weight_sync.interface import WeightSyncError, WeightSyncTimeoutError
from sglang_bridge.weight_sync.plan import BucketLayout, InputMeta, meta_from_json
from sglang_bridge.weight_sync.server_calls import ServerCalls


class RemoteSources:
    """Sources ``1 .. count - 1`` of a coordinator on ``control``, in a new generation of groups.

    Args:
        control: the store the sources joined.
        count: sources in all, the coordinator's own included.
        calls: the coordinator's HTTP calls to its servers.
        group_base: the coordinator's group name; source ``s``'s group is ``<group_base>_s<s>``.
        world / offsets: every group's world size (1 + all servers' TP ranks) and each server's
            rank offset in it, the same as in the coordinator's own group.
        backend: "gloo" or "nccl".
        timeout_s: how long any one step may wait.
    """

    def __init__(
        self,
        control: ControlStore,
        count: int,
        calls: ServerCalls,
        *,
        group_base: str,
        world: int,
        offsets: Sequence[int],
        backend: str,
        timeout_s: float,
    ):
        self.control = control
        self.count = count
        self._calls = calls
        self.group_base = group_base
        self.world = world
        self.offsets = list(offsets)
        self.backend = backend
        self.timeout_s = timeout_s
        self.gen = control.counter("gen", 1)
        self.labels = {s: f"source {s}" for s in range(1, count)}
        self.connected: set[int] = set()
        self.seq = 0
        """The sync in progress (or the last one)."""
        self._keys: dict[int, list[str]] = {}

    def group_name(self, s: int) -> str:
        return f"{self.group_base}_s{s}"

    # -- one sync: start, groups, metadata, go ----------------------------------------------------
    def start(self, settings: Mapping[str, Any]) -> int:
        """Open sync number ``seq`` for the sources (its generation, groups and ``settings``); returns
        ``seq``. Forgets the keys of the sync before the last one (every source is past it)."""
        seq = self.seq = self.control.counter("seq", 1)
        self.control.put(
            f"sync/{seq}",
            {**settings, "gen": self.gen, "group_base": self.group_base, "world": self.world},
        )
        self._keys[seq] = [f"sync/{seq}", f"go/{seq}", f"result/{seq}"]
        self._keys[seq] += [f"meta/{seq}/{s}" for s in self.labels]
        for old in [k for k in self._keys if k < seq - 1]:
            self.control.delete(self._keys.pop(old))
        return seq

    @staticmethod
    def refuse(control: ControlStore, error: str) -> None:
        """The coordinator cannot even start a sync (``error``): tell the sources waiting for it."""
        seq = control.counter("seq", 1)
        control.put(f"sync/{seq}", {"error": error})

    def connect_pending(self) -> None:
        """Form the update group of every source that has none in this generation, one at a time:
        wait for the source's registration, then have every server join it."""
        for s in sorted(set(self.labels) - self.connected):
            reg = self.control.get(f"reg/{self.gen}/{s}", f"the registration of source {s}")
            self.labels[s] = str(reg["label"])
            name = self.group_name(s)

            async def init_all(
                host: str = reg["address"], port: int = int(reg["port"]), name: str = name
            ) -> list[Any]:
                return list(
                    await asyncio.gather(
                        *(
                            c.init_weights_update_group(host, port, off, self.world, name, self.backend)
                            for c, off in zip(self._calls.clients, self.offsets, strict=True)
                        )
                    )
                )

            try:
                results = self._calls.submit(init_all()).result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError as e:
                raise WeightSyncTimeoutError(
                    f"the servers did not join {self.labels[s]}'s update group within {self.timeout_s}s"
                ) from e
            for url, r in zip(self._calls.urls, results, strict=True):
                if not (isinstance(r, dict) and r.get("success")):
                    raise WeightSyncError(f"{url} refused {self.labels[s]}'s update group: {r}")
            self.connected.add(s)

    def metas(self, seq: int) -> dict[int, list[InputMeta]]:
        """What every remote source declared for sync ``seq``; a source that could not declare
        fails the sync, named."""
        out = {}
        for s in sorted(self.labels):
            got = self.control.get(f"meta/{seq}/{s}", f"the tensor list of {self.labels[s]}")
            if "error" in got:
                raise WeightSyncError(f"{self.labels[s]} could not declare its tensors: {got['error']}")
            out[s] = meta_from_json(got["meta"])
        return out

    def go(self, seq: int, *, slots: Mapping[int, list[int]] | None = None, error: str = "") -> None:
        """Let the sources send (``slots``: each source's places in the bucket order), or tell them
        the update is refused (``error``) and nothing will be sent."""
        if error:
            self.control.put(f"go/{seq}", {"ok": False, "error": error})
            return
        assert slots is not None
        self.control.put(f"go/{seq}", {"ok": True, "slots": {str(s): v for s, v in slots.items()}})
        self._keys[seq] += [f"{k}/{seq}/{r}" for v in slots.values() for r in v for k in ("posted", "joined")]

    # -- one bucket of a remote source -------------------------------------------------------------
    def post(self, seq: int, s: int, slot: int, layout: BucketLayout, flush: bool) -> InFlight:
        """Ask every server for source ``s``'s bucket at ``slot`` (``layout``), then tell the source
        to broadcast it; ``flush``: the request also resets the radix cache (the update's last bucket,
        unless an in_place pause keeps the requests' KV)."""
        fut = self._calls.submit_all(
            "update_weights_from_distributed",
            layout.names,
            layout.dtypes,
            layout.shapes,
            self.group_name(s),
            load_format="flattened_bucket",
            flush_cache=flush,
        )
        f = InFlight(layout, -1, fut, None, source=self.labels[s], slot=slot)
        fut.add_done_callback(lambda _: setattr(f, "answered_at", time.perf_counter()))
        self.control.put(f"posted/{seq}/{slot}", "go")
        return f

    def await_joined(self, seq: int, f: InFlight, finish: Callable[[InFlight], int]) -> None:
        """Block until the source says every server joined ``f``'s broadcast; ``finish`` (the
        coordinator's check of the servers' answers) runs if they answer first, which raises what a
        server that refused the bucket said."""
        key = f"joined/{seq}/{f.slot}"
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0002
        while (got := self.control.poll(key)) is None:
            if f.fut.done():
                try:
                    finish(f)
                except WeightSyncError as e:
                    # A source that failed reports why before it tears its group down, which is
                    # what fails the servers' receive: its reason, not the lost peer, names it.
                    got = self.control.poll(key)
                    if got is not None and "error" in got:
                        raise WeightSyncError(f"{f.source} failed: {got['error']}") from e
                    raise
                if (got := self.control.poll(key)) is None:
                    return  # every server loaded it: joined, whatever the source says later
                break
            if time.monotonic() > deadline:
                raise WeightSyncTimeoutError(f"bucket{f.where} not received after {self.timeout_s}s")
            time.sleep(pause)
            pause = min(2 * pause, 0.002)
        if "error" in got:
            raise WeightSyncError(f"{f.source} failed: {got['error']}")

    # -- the end of a sync -------------------------------------------------------------------------
    def finish(self, seq: int, *, error: str = "", unposted: Sequence[int] = ()) -> None:
        """Tell the sources how sync ``seq`` ended; after a failure, wake every source still waiting
        for a slot that will never be posted."""
        self.control.put(f"result/{seq}", {"ok": not error, "error": error})
        for r in unposted:
            self.control.put(f"posted/{seq}/{r}", "abort")

    def destroy(self) -> None:
        """Have the servers leave every remote source's group (best effort: at close)."""
        for s in sorted(self.connected):
            self._calls.all("destroy_weights_update_group", self.group_name(s))
        self.connected.clear()
