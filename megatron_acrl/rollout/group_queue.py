"""The async producer's bookkeeping: which prompt groups are live, when each must be trained, and
which finished ones the next step takes. Pure Python (no threads, no servers); the generation engine
(:mod:`megatron_acrl.rollout.engine`) drives it under a lock.

Versions are integers (:mod:`megatron_acrl.batch.staleness`). A group admitted while the servers serve
version ``a`` has every token at version >= ``a``, so it may be trained up to step ``a + K``: its
*deadline* (K = ``rollout.max_staleness``). With ``stale_policy: wait`` the queue admits a group
only when the steps up to its deadline can still take every live group by its own deadline:

    live groups + 1 <= (a + K - next_step + 1) x B        (B = rollout.prompts_per_step)

and each step takes, earliest deadline first, ``B`` finished groups, waiting for any live group
whose deadline is this step. Deadlines grow with admission order, so this schedule never trains a
token older than K and never drops finished work. With ``stale_policy: drop`` admission only bounds
the live groups by ``(K + 1) x B`` (the servers never wait on the bound) and a step drops the
finished groups whose oldest token is already older than K.

DAPO dynamic sampling drops groups whose rewards are all equal as they finish (they free their
place); once a step has dropped ``max_refill_rounds x B`` of them it tops up from the dropped ones
still within K, and keeps every group that finishes after that, as the synchronous refill does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_acrl.batch.rollout_batch import RolloutBatch
from megatron_acrl.tasks.base import Prompt


@dataclass
class Group:
    """One prompt and its samples on their way through the queue."""

    gid: int
    """Position of the prompt in the run's admission order (its group id in the batch)."""
    prompt: Prompt
    admitted_version: int
    """The version the servers served when it was admitted (every token is at least as new)."""
    batch: RolloutBatch | None = None
    """Its scored samples, once every one has finished."""
    oldest_version: int | None = None
    """The oldest version among its tokens, once finished."""

    def deadline(self, max_staleness: int) -> int:
        return self.admitted_version + max_staleness


@dataclass
class TakeResult:
    """A step's groups (admission order) and how many of them are dynamic sampling's top-up."""

    groups: list[Group]
    topped_up: int = 0


@dataclass
class GroupQueue:
    """Live groups of the async producer (module doc). ``next_step``: the step the next take is for."""

    batch_groups: int
    max_staleness: int
    policy: Literal["wait", "drop"] = "wait"
    dynamic_sampling: bool = False
    refill_groups: int = 0
    """Groups dynamic sampling may drop per step before topping up (max_refill_rounds x B)."""
    next_step: int = 0
    live: dict[int, Group] = field(default_factory=dict)
    spare: list[Group] = field(default_factory=list)
    """Groups dropped by dynamic sampling since the last take (zero advantage: the top-up)."""
    filtered: int = 0
    """Groups dynamic sampling dropped since the last take."""
    dropped_stale: int = 0
    """Finished groups dropped as too stale (``stale_policy: drop``), over the run."""

    # -- admission ---------------------------------------------------------------------------------

    def capacity(self, served_version: int) -> int:
        """How many groups may be admitted now, while the servers serve ``served_version``."""
        if self.policy == "drop":
            room = (self.max_staleness + 1) * self.batch_groups
        else:
            room = (served_version + self.max_staleness - self.next_step + 1) * self.batch_groups
        return max(0, room - len(self.live))

    def admit(self, gid: int, prompt: Prompt, served_version: int) -> Group:
        if gid in self.live:
            raise ValueError(f"group {gid} is already live")
        g = Group(gid, prompt, served_version)
        self.live[gid] = g
        return g

    # -- completion ----------------------------------------------------------------------------------

    @property
    def filtering(self) -> bool:
        """Whether dynamic sampling still drops constant-reward groups this step."""
        return self.dynamic_sampling and self.filtered < self.refill_groups

    def finish(self, gid: int, batch: RolloutBatch, keep: bool = True) -> None:
        """Group ``gid``'s samples are scored; ``keep=False``: dynamic sampling drops it."""
        g = self.live[gid]
        g.batch = batch
        versions = batch.token_versions
        if versions is not None and bool((versions >= 0).any()):
            g.oldest_version = int(versions[versions >= 0].min())
        else:
            g.oldest_version = g.admitted_version
        if not keep and self.filtering:
            del self.live[gid]
            self.spare.append(g)
            self.filtered += 1

    # -- the step's batch ---------------------------------------------------------------------------

    def ready(self) -> list[Group]:
        return [g for g in self.live.values() if g.batch is not None]

    def take(self, step: int) -> TakeResult | None:
        """The groups step ``step`` trains on, or None while it must wait for more."""
        if step != self.next_step:
            raise ValueError(f"the queue is at step {self.next_step}, not {step}")
        if self.policy == "drop":
            self.dropped_stale += self._drop_stale(step)
        else:
            due = [g for g in self.live.values() if g.deadline(self.max_staleness) <= step]
            if len(due) > self.batch_groups:
                raise RuntimeError(
                    f"{len(due)} groups are due at step {step}, more than a batch of {self.batch_groups}: "
                    "the admission bound was broken"
                )
            if any(g.batch is None for g in due):
                return None
        # Earliest deadline first: the due groups (all finished now) lead.
        ready = sorted(self.ready(), key=lambda g: (g.deadline(self.max_staleness), g.gid))
        take = ready[: self.batch_groups]
        topped: list[Group] = []
        if len(take) < self.batch_groups and self.dynamic_sampling and not self.filtering:
            fresh = [g for g in self.spare if step - (g.oldest_version or 0) <= self.max_staleness]
            topped = fresh[: self.batch_groups - len(take)]
        if len(take) + len(topped) < self.batch_groups:
            return None
        if self.policy == "wait" and not self._feasible_without(take, step):
            return None  # a later group finished first, but an earlier one would then miss its deadline
        for g in take:
            del self.live[g.gid]
        self.spare, self.filtered = [], 0
        self.next_step = step + 1
        return TakeResult(sorted(take + topped, key=lambda g: g.gid), len(topped))

    def _feasible_without(self, take: list[Group], step: int) -> bool:
        """After ``take`` trains at ``step``, can every other live group still be trained by its
        deadline, ``B`` groups a step? (Every d: live groups due by d <= (d - step) x B.)"""
        taken = {g.gid for g in take}
        rest = sorted(g.deadline(self.max_staleness) for g in self.live.values() if g.gid not in taken)
        return all(i <= (d - step) * self.batch_groups for i, d in enumerate(rest, 1))

    def _drop_stale(self, step: int) -> int:
        """``stale_policy: drop``: remove finished groups already older than K at ``step``."""
        stale = [
            g
            for g in self.ready()
            if g.oldest_version is not None and step - g.oldest_version > self.max_staleness
        ]
        for g in stale:
            del self.live[g.gid]
        return len(stale)

    # -- checkpoint -----------------------------------------------------------------------------------

    def pending(self) -> list[Group]:
        """Live groups in admission order: admitted, not yet trained (what a resume regenerates)."""
        return sorted(self.live.values(), key=lambda g: g.gid)
