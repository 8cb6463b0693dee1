"""One bucket on its way to the servers (:class:`InFlight`) and how a coordinator moves it: post its
request to every server and start its broadcast, wait until every server has joined that broadcast,
wait until every server has loaded it, and after a failure let the ones still in flight land.

A bucket of a remote source (:mod:`~sglang_bridge.weight_sync.source`) has no broadcast here: the
source broadcasts it on its own group and signals when every server has joined
(:meth:`BucketTransfer._await_remote`, the coordinator's).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from sglang_bridge.weight_sync.buckets import Bucket
from sglang_bridge.weight_sync.interface import WeightSyncError, WeightSyncTimeoutError
from sglang_bridge.weight_sync.plan import BucketLayout
from sglang_bridge.weight_sync.update_group import broadcast_async

if TYPE_CHECKING:
    from sglang_bridge.client import PauseMode
    from sglang_bridge.weight_sync.server_calls import ServerCalls

_NOT_FLUSHED = "cache was not flushed"
"""SGLang's answer when a bucket loaded but its flush found requests still being retracted."""


@dataclass
class InFlight:
    """A bucket on its way: the servers' answers (``fut``), the broadcast (``work``; None for a remote
    source's bucket), the send buffer it occupies (``idx``), ``answered_at``, the ``perf_counter``
    time every server had answered (0 until then), and ``loaded``, set once every server's answer
    was checked. ``source`` names the source it comes from (empty with one source) and ``slot`` its
    place in the update's order."""

    bucket: Bucket | BucketLayout
    idx: int
    fut: concurrent.futures.Future[Any]
    work: dist.Work | None
    answered_at: float = 0.0
    loaded: bool = False
    source: str = ""
    slot: int = 0

    @property
    def where(self) -> str:
        """`` from <source>`` for error messages (empty with one source)."""
        return f" from {self.source}" if self.source else ""


class BucketTransfer:
    """The bucket-level half of :class:`~sglang_bridge.weight_sync.distributed.DistributedWeightSynchronizer`
    (it sets ``urls``, ``_calls``, ``group``, ``group_name``, ``backend``, ``timeout_s`` and
    ``pause_mode``)."""

    urls: list[str]
    _calls: ServerCalls
    group: dist.ProcessGroup | None
    group_name: str
    backend: str
    timeout_s: float
    pause_mode: PauseMode

    def _post_bucket(self, bucket: Bucket, idx: int) -> InFlight:
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
        f = InFlight(bucket, idx, fut, work)
        fut.add_done_callback(lambda _: setattr(f, "answered_at", time.perf_counter()))
        return f

    def _await_remote(self, f: InFlight) -> None:
        raise NotImplementedError  # the coordinator's, for buckets of remote sources

    def _await_joined(self, f: InFlight) -> None:
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
        if f.work is None:
            self._await_remote(f)
            return
        # gloo's root finishes a broadcast only once every receiver has joined it, whatever its size
        # (checked by tests/bridge/test_weight_sync.py). Polled: with a done-callback on the
        # broadcast's future instead, every transfer on the group was slower (the benchmark's raw
        # transfers: 0.16-0.18 s with it, 0.13 s without, in alternating runs).
        deadline = time.monotonic() + self.timeout_s
        while not (f.work.is_completed() or f.fut.done()):
            if time.monotonic() > deadline:
                raise WeightSyncTimeoutError(f"bucket{f.where} not received after {self.timeout_s}s")
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
            raise WeightSyncTimeoutError(f"bucket{f.where} not received after {self.timeout_s}s ({e})") from e

    def _finish_bucket(self, f: InFlight, timeout_s: float | None = None) -> int:
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
            raise WeightSyncTimeoutError(f"bucket{f.where} not loaded after {timeout_s:g}s") from e
        except Exception as e:
            raise WeightSyncError(
                f"a server failed the bucket{f.where}: {e}; the update group is now unusable (reconnect)"
            ) from e
        loaded = [
            isinstance(r, dict) and (r.get("success") or _NOT_FLUSHED in r.get("message", ""))
            for r in results
        ]
        if all(loaded) and f.work is not None:
            f.work.wait(timeout=timedelta(seconds=max(timeout_s, 1.0)))  # done: all received it
        for url, c, r, ok in zip(self.urls, self._calls.clients, results, loaded, strict=True):
            if ok and not r.get("success"):
                # Loaded, but requests were still being retracted: flush on its own, with retries.
                self._calls.run(c.flush_cache())
            elif not (isinstance(r, dict) and r.get("success")):
                raise WeightSyncError(
                    f"{url} failed to load bucket {f.bucket.names[:3]}...{f.where}: {r}; "
                    "the update group may be unusable (reconnect)"
                )
        f.loaded = True
        return f.bucket.nbytes

    def _drain(self, inflight: list[InFlight], error: Exception) -> None:
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
