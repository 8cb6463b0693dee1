"""The generating half of a :class:`~megatron_acrl.rollout.backend.RolloutBackend` over servers that
are already running: what the agent tests, ``benchmarks/agent_rollout.py`` and a stand-alone OpenAI
session endpoint (:mod:`megatron_acrl.rollout.agent.openai_server`) generate through.

It goes through the run's one dispatch path (:class:`~megatron_acrl.servers.dispatch.Dispatch`):
the same affinity pins (an agent trajectory's turns to one server while it is a target), the same
in-flight counts and the same clients; with ``router=True`` the one URL is an sglang-router and a
request goes as one prompt with the affinity key as its routing-key header (the router's
``consistent_hashing`` policy). The run itself uses :class:`~megatron_acrl.servers.handle.RolloutServers`,
which starts, syncs and restarts its servers; this class starts nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from megatron_acrl.servers.dispatch import Dispatch
from sglang_bridge.client import SGLangClient
from sglang_bridge.samples import Sample, SamplingParams


class ServerBackend:
    """Generation on ``urls`` (each an SGLang server, or one sglang-router with ``router=True``).

    Args:
        urls: where requests go; an affinity key pins to one of them.
        params: the sampling :meth:`sampling_params` hands out.
        api_key: the servers' (or router's) key.
        max_concurrency: requests in flight per URL.
        router: ``urls`` is one sglang-router: one prompt per request, the key as a header.
    """

    restarts = 0

    def __init__(
        self,
        urls: Sequence[str],
        params: SamplingParams | None = None,
        *,
        api_key: str | None = None,
        max_concurrency: int = 64,
        router: bool = False,
    ):
        if not urls:
            raise ValueError("ServerBackend.urls: give at least one server URL")
        if router and len(urls) != 1:
            raise ValueError(f"ServerBackend(router=True) takes the router's one URL, got {list(urls)}")
        self.urls = [u.rstrip("/") for u in urls]
        self.params = params or SamplingParams()
        self.router = router
        self.cap = max_concurrency
        self.dispatch = Dispatch(lambda url, cap: SGLangClient(url, api_key=api_key, max_concurrency=cap))

    def sampling_params(self, *, greedy: bool = False, seed: int | None = None) -> SamplingParams:
        """The given sampling, or greedy decoding; ``seed`` per request."""
        p = dataclasses.replace(self.params, temperature=0.0) if greedy else self.params
        return dataclasses.replace(p, seed=seed) if seed is not None else p

    def generate_async(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *, affinity: str | None = None
    ) -> asyncio.Future[list[Sample]]:
        """One sample per prompt, sent now (:meth:`Dispatch.send`); ``affinity`` pins the server."""
        return self.dispatch.send(
            self.urls, prompt_ids, params, cap=self.cap, batched=not self.router, affinity=affinity
        )

    def unpin(self, affinity: str) -> None:
        """Forget ``affinity``'s server: its trajectory ended (:meth:`Dispatch.unpin`)."""
        self.dispatch.unpin(affinity)

    def in_flight(self) -> dict[str, int]:
        return self.dispatch.in_flight(self.urls)

    async def aclose(self) -> None:
        """Close the calling event loop's clients."""
        await self.dispatch.aclose()
