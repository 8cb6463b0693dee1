"""The rollout backend: what the rollout layer asks of the servers that generate its samples.

Sync mode (:func:`megatron_acrl.rollout.phase.sample_groups`), evaluation
(:mod:`megatron_acrl.rollout.evaluate`) and the async generation engine
(:class:`megatron_acrl.rollout.engine.GenerationEngine`) type against :class:`RolloutBackend` and
nothing else; the run's :class:`megatron_acrl.servers.handle.RolloutServers` implements it
structurally (the servers layer never imports this one), and ``tests/fake_backend.py`` implements it
in memory for the unit tests of the producer, the rollout phase and the engine.

Both ways of generating go through one dispatch path in the implementation
(:mod:`megatron_acrl.servers.dispatch`): the same targets (the live servers, least outstanding
first, or the one sglang-router in front of them with ``rollout.router: sglang``), the same clients,
the same in-flight count.

The output spec is :class:`~sglang_bridge.samples.Sample`, one per generated continuation:

==================  =====================================================================================
``prompt_ids``      the prompt's token ids, as sent
``output_ids``      the generated token ids (EOS included when the sample stopped on it)
``rollout_logprobs`` log mu of each output token, ``len == len(output_ids)``, at ``logprob_temperature``
``finish_reason``   ``"stop"``, ``"length"`` or ``"abort"`` (aborted by a pause: generate it again)
``weight_version``  the served version when it finished; ``weight_versions`` the segments
                    ``{"version", "start", "end"}`` over its output tokens (a sample paused across a
                    weight update spans two)
``routed_experts``  MoE routing int32 ``[P + O - 1, layers, top_k]`` when requested, else None
==================  =====================================================================================
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from sglang_bridge.samples import Sample, SamplingParams


class RolloutBackend(Protocol):
    """The servers as the rollout layer sees them (module doc). Rank 0 only."""

    restarts: int
    """Server restarts so far: the engine resubmits its lost requests once this moves."""
    hung_restarts: int
    """Servers killed and replaced because they hung (in a rollout or a weight sync)."""
    router_restarts: int
    """Times a dead router was started again."""

    def sampling_params(self, *, greedy: bool = False, seed: int | None = None) -> SamplingParams:
        """The run's sampling (``rollout.*``), or greedy decoding (evaluation)."""
        ...

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        """``n`` samples of each prompt, blocking (sync mode, evaluation); ``result[i]`` holds
        prompt i's. A dead server's groups go to the others; raises
        :class:`~sglang_bridge.transport.ServerGoneError` when no target is left to take them."""
        ...

    def generate_async(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *, affinity: str | None = None
    ) -> asyncio.Future[list[Sample]]:
        """Send one batched request now, one sample per prompt, from inside a running event loop
        (the async engine, the agent loop): its target is chosen and counted in flight at this call,
        and the future holds ``result[i]``, prompt i's sample, or the request's error (a
        ``ServerGoneError`` or ``TimeoutError`` when its server is gone). ``affinity`` (an agent
        trajectory's id) sends every request with that key to the same server while it lives, so
        the turns of one trajectory reuse its prefix cache."""
        ...

    def unpin(self, affinity: str) -> None:
        """Forget ``affinity``: its trajectory ended (finished, truncated, failed, regenerated), so
        the pins held are those of the trajectories in flight (an unknown key is no error)."""
        ...

    def in_flight(self) -> dict[str, int]:
        """Samples in flight per dispatch target (each server, or the router): the same keys from
        call to call until a restart."""
        ...

    async def aclose(self) -> None:
        """Close the clients the calling event loop's requests used (the engine, on its way out)."""
        ...

    def pause(self, mode: str = "retract") -> None:
        """Pause generation on every live server (``abort``: the requests in flight end with
        ``finish_reason == "abort"``); a weight sync pauses and continues on its own."""
        ...

    def resume(self) -> None:
        """Continue the paused requests."""
        ...

    def dead_servers(self) -> list[int]:
        """The servers whose process has exited."""
        ...

    def restart(self) -> None:
        """Restart the dead servers (or a dead router); the served weights must be re-sent."""
        ...

    def recover_rollout(self, error: BaseException) -> str | None:
        """After a rollout failed with ``error``: restart a dead server, kill and replace a hung one,
        restart a dead router; returns what was done (the served weights must then be re-sent), or
        None when nothing is found wrong (the error is the request's own: fatal)."""
        ...

    def load_metrics(self) -> dict[str, float]:
        """Routing and per-server load of the blocking generations since the last call."""
        ...

    def score(self, sequences: Sequence[Sequence[int]], target_lens: Sequence[int]) -> list[list[float]]:
        """The served log-probs of the last ``target_lens[i]`` tokens of each sequence."""
        ...


__all__ = ["RolloutBackend", "Sample", "SamplingParams"]
