"""What every weight synchronizer offers, whatever its transport: the :class:`WeightSynchronizer`
interface, its reports (:class:`SyncReport`, :class:`VerifyReport`) and its error types."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch


class WeightSyncError(RuntimeError):
    """A weight update failed; the message says what state the servers were left in."""


class WeightSyncTimeoutError(WeightSyncError, TimeoutError):
    """A server did not join a broadcast or answer within ``timeout_s``: it is hung, gone or far
    slower than the timeout allows. Its requests may still be pending in it, so recover through a
    new synchronizer (``close()``, then ``connect()`` a fresh one), not by retrying on this group."""


@dataclass
class SyncReport:
    version: str
    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float
    fp8: str
    """"none", "real" (FP8 tensors sent) or "fake-quant" (FP8-rounded bf16 sent to a bf16 server)."""
    timings: dict[str, float] = field(default_factory=dict)
    sources: dict[str, int] = field(default_factory=dict)
    """Bytes each source sent, by its label (a sync with several sources; empty with one)."""

    @property
    def gbytes_per_s(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-9) / 1e9


@dataclass
class VerifyReport:
    version: str
    max_abs_delta: float
    mean_abs_delta: float
    num_tokens: int
    per_prompt_max: list[float]

    def ok(self, tol: float) -> bool:
        return self.max_abs_delta <= tol


ReferenceLogprobs = Callable[[list[list[int]], list[list[int]], float], list[list[float]]]
"""``(prompt_ids, output_ids, temperature) -> per-output-token log-probs`` computed by the trainer."""


class WeightSynchronizer(ABC):
    """Keeps rollout servers on the trainer's weights."""

    version: str | None

    @abstractmethod
    def connect(self) -> None:
        """Set up the transport to the servers."""

    @abstractmethod
    def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        version: str,
        *,
        quantize: bool = True,
    ) -> SyncReport:
        """Replace the served weights by ``named_tensors`` (HF names, full tensors) as ``version``.

        ``quantize=False`` sends them as they are even where the synchronizer FP8-quantizes (only to
        a server that holds bf16 weights, i.e. fake-quant: e.g. to evaluate the trainer's own weights).
        """

    @abstractmethod
    def verify(
        self,
        prompts: Sequence[Sequence[int]],
        reference: ReferenceLogprobs,
        *,
        max_new_tokens: int = 8,
        temperature: float = 1.0,
    ) -> VerifyReport:
        """Compare the servers' log-probs on ``prompts`` with the trainer's ``reference``."""

    @abstractmethod
    def close(self) -> None:
        """Tear the transport down (idempotent)."""

    def __enter__(self) -> WeightSynchronizer:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
