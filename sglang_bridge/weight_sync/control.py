"""The control channel of a weight sync with several sources: a TCP store hosted next to the
coordinator, carrying small JSON values between it and the remote sources (registrations, declared
metadata, go / posted / joined / result signals). Never a tensor, never a pickle.

It outlives synchronizers: a new coordinator on the same store starts a new *generation* of update
groups, which the sources join at their next sync. Keys (``g`` generation, ``n`` the sync's sequence
number, ``s`` a source, ``r`` a slot of the sync's bucket order):

==================  ==========================  =============================================
key                 from -> to                  what
==================  ==========================  =============================================
``gen``, ``seq``    counters                    generations of groups, syncs started so far
``reg/g/s``         source -> coordinator       where its group's store listens, its label
``sync/n``          coordinator -> sources      generation, group names, settings, version
``meta/n/s``        source -> coordinator       the tensors it will send (or why it cannot)
``go/n``            coordinator -> sources      the update passed the manifest: each source's slots
``posted/n/r``      coordinator -> source       slot r's request is with the servers (or ``abort``)
``joined/n/r``      source -> coordinator       every server joined slot r's broadcast (or why not)
``result/n``        coordinator -> sources      how the update ended
==================  ==========================  =============================================
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from sglang_bridge.weight_sync.interface import WeightSyncError, WeightSyncTimeoutError


class ControlStore:
    """JSON values under string keys in a ``torch.distributed.TCPStore`` (see module doc).

    :meth:`host` binds one (port 0: the OS picks a free port at bind time); :meth:`join` connects to
    it from another process, given the :attr:`address` the host's driver passed on."""

    def __init__(self, store: dist.Store, address: tuple[str, int], timeout_s: float):
        self._store = store
        self.address = address
        """(host, port) other processes :meth:`join`."""
        self.timeout_s = timeout_s

    @classmethod
    def host(cls, address: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 300.0) -> ControlStore:
        """Host the store on ``port`` (0: a free one); ``address`` is where the others reach this host."""
        try:
            store = dist.TCPStore(
                address,
                port,
                None,
                is_master=True,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as e:
            raise WeightSyncError(
                f"cannot host the weight-sync control store on {address}:{port} ({e}); leave the port "
                "unset (0) to let the OS pick a free one, or choose one that is free"
            ) from e
        return cls(store, (address, store.port), timeout_s)

    @classmethod
    def join(cls, address: str, port: int, *, timeout_s: float = 300.0) -> ControlStore:
        """Connect to a store :meth:`host` made (``address``/``port``: its :attr:`address`)."""
        try:
            store = dist.TCPStore(address, port, None, is_master=False, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as e:
            raise WeightSyncError(
                f"cannot reach the weight-sync control store at {address}:{port}: {e}"
            ) from e
        return cls(store, (address, port), timeout_s)

    def put(self, key: str, value: Any) -> None:
        self._store.set(key, json.dumps(value))

    def poll(self, key: str) -> Any | None:
        """The value under ``key``, or None if it is not set (yet)."""
        if not self._store.check([key]):
            return None
        return json.loads(self._store.get(key))

    def get(self, key: str, what: str, timeout_s: float | None = None) -> Any:
        """The value under ``key``, waiting up to ``timeout_s`` (default :attr:`timeout_s`) for it;
        :class:`WeightSyncTimeoutError` saying ``what`` did not come otherwise."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            self._store.wait([key], timedelta(seconds=timeout_s))
        except dist.DistStoreError as e:
            if "timeout" in str(e).lower():
                raise WeightSyncTimeoutError(f"{what} did not come within {timeout_s:g}s") from e
            raise WeightSyncError(f"weight-sync control store lost while waiting for {what}: {e}") from e
        return json.loads(self._store.get(key))

    def wait_any(self, keys: Iterable[str], what: str, timeout_s: float | None = None) -> tuple[str, Any]:
        """The first of ``keys`` that is set and its value, polled (a blocking wait would take one)."""
        keys = list(keys)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        pause = 0.0002
        while True:
            for key in keys:
                if (value := self.poll(key)) is not None:
                    return key, value
            if time.monotonic() > deadline:
                raise WeightSyncTimeoutError(f"{what} did not come within {timeout_s or self.timeout_s:g}s")
            time.sleep(pause)
            pause = min(2 * pause, 0.005)

    def counter(self, key: str, add: int = 0) -> int:
        """Atomically add ``add`` to the integer counter ``key`` (0 if unset) and return its value."""
        return int(self._store.add(key, add))

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._store.delete_key(key)
