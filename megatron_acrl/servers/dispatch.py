"""The one dispatch path of the rollout servers' handle: every generation request, blocking or
async, goes through :class:`Dispatch`.

The handle (:class:`megatron_acrl.servers.handle.RolloutServers`) names the *targets* (the live
servers, or the one sglang-router in front of them) and the requests each may hold; the dispatch
owns the rest:

* the clients, one per target and event loop (an aiohttp session belongs to the loop that made it:
  a blocking generation runs its own loop and closes its clients after; the async engine keeps its
  loop's clients until it closes);
* the in-flight count, samples per target, that both ways keep: :meth:`Dispatch.fan_out` (a whole
  batch of groups, :func:`sglang_bridge.fanout.fan_out`, least outstanding first, a dead target's
  groups to the others) and :meth:`Dispatch.send` (one batched request to the target with the fewest
  samples in flight, counted at the call, so a caller that waits for "nothing in flight" never
  misses a request that has not started yet). Through sglang-router, which takes one prompt per
  request, the samples of one prompt go as one request with ``n`` instead (:func:`by_prompt`);
* with LoRA adapters on the servers (``model.lora.sync: adapter``), the adapter each request names:
  the current version when it is sent (``lora_path``), counted until it ends so that an old version
  is unloaded only once no request names it, and recorded on its samples as their version
  (:mod:`megatron_acrl.servers.lora_sync`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from sglang_bridge.fanout import FanOutResult, fan_out
from sglang_bridge.samples import Sample, SamplingParams


class Dispatch:
    """Clients and in-flight counts of the rollout requests (module doc).

    Args:
        new_client: ``(url, max_concurrency) -> client`` (an :class:`sglang_bridge.client.SGLangClient`
            or anything with its ``generate_group`` / ``generate_batch`` / ``health`` / ``aclose``).
        adapters: the servers' LoRA adapter versions (an
            :class:`~megatron_acrl.servers.lora_sync.AdapterSync`: ``acquire`` / ``release``), or None
            when they serve full weights.
    """

    def __init__(self, new_client: Callable[[str, int], Any], adapters: Any = None):
        self._new_client = new_client
        self.adapters = adapters
        self._lock = threading.Lock()  # the engine's loop thread and the trainer's thread both count
        self._counts: dict[str, int] = {}
        # affinity key -> the target its first request went to; a key lives as long as its trajectory
        # (the agent session unpins it when it ends), so this holds the trajectories in flight only
        self._pins: dict[str, str] = {}
        self._clients: dict[asyncio.AbstractEventLoop, dict[str, Any]] = {}

    def client(self, url: str, cap: int) -> Any:
        """The running event loop's client of ``url`` (made on first use, holding ``cap`` requests)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            mine = self._clients.setdefault(loop, {})
            if url not in mine:
                mine[url] = self._new_client(url, cap)
            return mine[url]

    def pinned(self) -> dict[str, str]:
        """The affinity keys pinned now and their targets (a copy): the trajectories in flight."""
        with self._lock:
            return dict(self._pins)

    def unpin(self, affinity: str) -> None:
        """Forget ``affinity``'s target (its trajectory ended); an unknown key is no error."""
        with self._lock:
            self._pins.pop(affinity, None)

    async def aclose(self) -> None:
        """Close the running event loop's clients."""
        with self._lock:
            mine = self._clients.pop(asyncio.get_running_loop(), {})
        await asyncio.gather(*(c.aclose() for c in mine.values()), return_exceptions=True)

    def count(self, url: str, samples: int) -> None:
        """``samples`` more (or, negative, fewer) in flight on ``url``."""
        with self._lock:
            self._counts[url] = max(0, self._counts.get(url, 0) + samples)

    def in_flight(self, slots: Sequence[str]) -> dict[str, int]:
        """Samples in flight on each of ``slots`` (0 where none was sent)."""
        with self._lock:
            return {u: self._counts.get(u, 0) for u in slots}

    async def fan_out(
        self,
        targets: Sequence[str],
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        n: int,
        *,
        cap: int,
        samples_per_request: int | None,
    ) -> FanOutResult:
        """``n`` samples of each prompt over ``targets``, ``cap`` requests in flight on each
        (:func:`sglang_bridge.fanout.fan_out`); ``result.groups[i]`` holds prompt i's."""
        clients = [_Counted(self, self.client(u, cap), self.adapters) for u in targets]
        return await fan_out(
            clients, prompt_ids, params, n, max_in_flight=cap, samples_per_request=samples_per_request
        )

    def send(
        self,
        targets: Sequence[str],
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        cap: int,
        batched: bool = True,
        affinity: str | None = None,
    ) -> asyncio.Future[list[Sample]]:
        """One sample per prompt from the target with the fewest samples in flight, in one batched
        ``/generate`` (``batched``), else in one request per run of equal prompts (:func:`by_prompt`);
        counted now, uncounted when it ends (also cancelled before it started).

        ``affinity`` (e.g. an agent trajectory's id) pins the target: every request with the same key
        goes to the server the first one went to while that server is among ``targets``, so the
        turns of one trajectory reuse its prefix cache; :meth:`unpin` forgets the key. Through
        sglang-router (not ``batched``) the key also goes as its routing-key header, which its
        ``consistent_hashing`` policy hashes to one worker while that worker lives (a hash ring of
        the workers: the router keeps nothing per key, so there is nothing to forget there)."""
        k = len(prompt_ids)
        with self._lock:
            url = self._pins.get(affinity) if affinity is not None else None
            if url is None or url not in targets:
                url = min(targets, key=lambda u: self._counts.get(u, 0))
                if affinity is not None:
                    self._pins[affinity] = url
            self._counts[url] = self._counts.get(url, 0) + k
        adapter = self.adapters.acquire() if self.adapters is not None else None
        try:
            client = self.client(url, cap)
            if adapter is not None:
                params = replace(params, lora_path=adapter)
            if batched:
                request = client.generate_batch(prompt_ids, [params] * k)
            else:
                request = by_prompt(client, prompt_ids, params, routing_key=affinity)
            if adapter is not None:
                request = _stamped(request, adapter)
        except BaseException:
            self._done(url, k, adapter)
            raise
        task = asyncio.ensure_future(request)
        task.add_done_callback(lambda _t: self._done(url, k, adapter))
        return task

    def _done(self, url: str, samples: int, adapter: str | None) -> None:
        self.count(url, -samples)
        if self.adapters is not None:
            self.adapters.release(adapter)


async def by_prompt(
    client: Any,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    routing_key: str | None = None,
) -> list[Sample]:
    """One sample per prompt, each run of equal consecutive prompts (a group's samples) in one
    request with SGLang's ``n``: what sglang-router takes (0.3.2 refuses a batch of prompts in one
    ``/generate``, HTTP 422). ``result[i]`` is prompt i's; ``routing_key`` (the router's
    consistent hashing) goes with each request."""
    runs: list[tuple[Sequence[int], int]] = []
    for p in prompt_ids:
        if runs and list(runs[-1][0]) == list(p):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    extra = {"routing_key": routing_key} if routing_key is not None else {}
    parts = await asyncio.gather(*(client.generate_group(p, params, n, **extra) for p, n in runs))
    return [s for part in parts for s in part]


def stamp(samples: list[Sample], adapter: str) -> list[Sample]:
    """:func:`megatron_acrl.servers.lora_sync.stamp`, imported when a LoRA run first needs it:
    lora_sync imports torch, and this module stays torch-free (the agent's direct backend uses it,
    an import-linter contract)."""
    from megatron_acrl.servers.lora_sync import stamp as stamp_adapter

    return stamp_adapter(samples, adapter)


async def _stamped(request: Awaitable[list[Sample]], adapter: str) -> list[Sample]:
    return stamp(await request, adapter)


class _Counted:
    """A client whose group requests count in :class:`Dispatch`'s in-flight tally (what
    :func:`~sglang_bridge.fanout.fan_out` calls), naming the current adapter with LoRA."""

    def __init__(self, dispatch: Dispatch, client: Any, adapters: Any = None):
        self._dispatch = dispatch
        self._client = client
        self._adapters = adapters
        self.url = client.url

    async def generate_group(self, prompt_ids: Sequence[int], params: SamplingParams, n: int) -> list[Sample]:
        self._dispatch.count(self.url, n)
        adapter = self._adapters.acquire() if self._adapters is not None else None
        try:
            if adapter is None:
                return await self._client.generate_group(prompt_ids, params, n)
            samples = await self._client.generate_group(prompt_ids, replace(params, lora_path=adapter), n)
            return stamp(samples, adapter)
        finally:
            self._dispatch._done(self.url, n, adapter)

    async def health(self) -> bool:
        health = getattr(self._client, "health", None)
        return bool(await health()) if health is not None else False


class LoadTally:
    """Per-server load of the fan-outs since the last :meth:`take` (``index``: URL -> server k)."""

    def __init__(self, index: dict[str, int]):
        self.index = index
        self._clear()

    def _clear(self) -> None:
        self.seconds = 0.0
        self.load_s: dict[int, float] = {}
        self.samples: dict[int, float] = {}
        self.requeued = 0
        self.timeouts = 0

    def add(self, result: FanOutResult, router_loads: dict[str, float], routed: bool) -> None:
        self.seconds += result.seconds
        self.requeued += result.requeued
        self.timeouts += result.timeouts
        if routed:  # through the router: its sampled per-worker counts (0 where none was seen)
            for url, k in self.index.items():
                self.load_s[k] = self.load_s.get(k, 0.0) + router_loads.get(url, 0.0) * result.seconds
            return
        for st in result.stats:
            j = self.index.get(st.url)
            if j is not None:
                self.load_s[j] = self.load_s.get(j, 0.0) + st.load_s
                self.samples[j] = self.samples.get(j, 0.0) + st.samples

    def take(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.seconds > 0 and self.load_s:
            loads = {k: v / self.seconds for k, v in sorted(self.load_s.items())}
            out.update({f"rollout/server_load/{k}": v for k, v in loads.items()})
            mean = sum(loads.values()) / len(loads)
            out["rollout/load_imbalance"] = max(loads.values()) / mean if mean > 0 else 1.0
        out.update({f"rollout/server_samples/{k}": v for k, v in sorted(self.samples.items())})
        out["rollout/requeued"] = float(self.requeued)
        out["rollout/timeouts"] = float(self.timeouts)
        self._clear()
        return out
