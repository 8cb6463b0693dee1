"""The lifecycle of one update on the servers, coordinated once whatever the number of sources:
open (pause generation, ``/begin_weight_update``), close (the completeness check of a streamed
update, ``/end_weight_update`` once every bucket is loaded, ``/update_weight_version``), resume
(continue generation), or fail (the servers stay paused, and the error says how to recover).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from sglang_bridge.client import PauseMode, SGLangClient, SGLangHTTPError
from sglang_bridge.weight_sync.inflight import BucketTransfer, InFlight
from sglang_bridge.weight_sync.interface import SyncReport, WeightSyncError, WeightSyncTimeoutError
from sglang_bridge.weight_sync.manifest import Manifest, ManifestMismatchError

log = logging.getLogger(__name__)


@dataclass
class Update:
    """One sync from open to close or fail: what it sends, its timings, the buckets still on their
    way (sent, not yet loaded by every server: at most two) and what has been sent so far."""

    version: str
    checked: bool
    """The whole input was validated up front (else each tensor is checked as it is packed)."""
    t0: float
    timings: dict[str, float]
    inflight: list[InFlight] = field(default_factory=list)
    sent: set[str] = field(default_factory=set)
    n_tensors: int = 0
    n_bytes: int = 0
    n_buckets: int = 0
    t_send: float = 0.0
    """``perf_counter`` time the first bucket was asked for."""
    source_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes sent per source (several sources only)."""
    reconnect: bool = False
    """A failure needs new update groups (a remote source's broadcast may be left pending)."""


class UpdateLifecycle(BucketTransfer):
    """The update-level half of :class:`~sglang_bridge.weight_sync.distributed.DistributedWeightSynchronizer`
    (which also sets ``manifest``, ``pause_mode``, ``require_complete``, ``version``, ``_dirty`` and
    ``fp8_label``)."""

    manifest: Manifest
    pause_mode: PauseMode
    require_complete: bool
    version: str | None
    _dirty: bool

    @property
    def fp8_label(self) -> str:
        raise NotImplementedError

    def _open_update(self, u: Update) -> None:
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

    def _close_update(self, u: Update) -> None:
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

    def _fail_update(self, u: Update, error: BaseException) -> WeightSyncError:
        """The error an update that failed after its open raises: the servers stay paused, and it
        says how to recover (a timeout, or a failure with a remote source's broadcast possibly left
        pending: through a new synchronizer; else: sync again)."""
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
                else "close() this synchronizer and connect() a new one (a source's broadcast may be "
                "left on its group), then sync again with the full weights"
                if u.reconnect
                else "call sync() again with the full weights to recover"
            )
        )

    def _resume_generation(self, u: Update) -> SyncReport:
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
            dict(u.source_bytes),
        )
        log.info(
            "weight sync %s: %d tensors, %.1f MB, %d buckets, %.3fs (fp8=%s)%s",
            u.version,
            u.n_tensors,
            u.n_bytes / 1e6,
            u.n_buckets,
            report.seconds,
            report.fp8,
            "".join(f"; {s}: {b / 1e6:.1f} MB" for s, b in u.source_bytes.items()),
        )
        return report

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
