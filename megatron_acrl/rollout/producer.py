"""Where the loop's batches come from: the rollout producer, a named object the loop pulls from.

Every rank holds one and calls each method (what the servers need goes through rank 0):

* :meth:`~Producer.next_batch` -- the step's rollout batch on every rank;
* :meth:`~Producer.publish` -- after the update: the servers serve the new version (or, with
  ``rollout.weight_lag_steps``, the lagged one), through the run's
  :class:`~megatron_acrl.servers.publisher.WeightPublisher`;
* :meth:`~Producer.evaluate` -- an evaluation of the served policy;
* :meth:`~Producer.step_metrics` -- ``time/trainer_idle``, ``time/server_idle`` and the queue;
* :meth:`~Producer.save_checkpoint` -- a checkpoint of the run with the producer's position.

:class:`SyncProducer` generates the step's batch when asked (``rollout.mode: sync``, today's loop
and its exact resume). :class:`AsyncProducer` (``mode: async``) takes a finished batch from rank 0's
:class:`~megatron_acrl.rollout.engine.GenerationEngine`, which keeps the servers generating within
``rollout.max_staleness`` while the trainer trains; weight updates pause and continue the
requests in flight (partial rollouts); with ``rollout.agent`` its samples are multi-turn agent
trajectories, which may span versions between and inside turns (docs/agents.md). On resume, the
groups it had admitted but not trained are generated again, first, with the same group ids
(docs/async.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_acrl.batch.rollout_batch import RolloutBatch, save_rollouts
from megatron_acrl.batch.staleness import format_version
from megatron_acrl.rollout.engine import GenerationEngine, PromptSource
from megatron_acrl.rollout.evaluate import evaluate, evaluate_exact, exact_due
from megatron_acrl.rollout.group_queue import GroupQueue
from megatron_acrl.rollout.phase import (
    ATTEMPTS,
    collect_rollouts,
    recovery_metrics,
    rollout_metrics,
    stopped_message,
)
from megatron_acrl.run.resume import DriverState, save_checkpoint
from megatron_acrl.servers.publisher import WeightPublisher
from megatron_acrl.tasks.base import Prompt
from megatron_acrl.world.distributed import log0
from megatron_acrl.world.vote import ERROR, NO_VERDICT, OK, RETRY, STOPPED, Verdict, vote

if TYPE_CHECKING:
    from megatron_acrl.run.context import RunContext


class Producer:
    """The interface the loop pulls from (module doc); the publisher is common to both."""

    def __init__(self, ctx: RunContext, publisher: WeightPublisher):
        self.ctx = ctx
        self.publisher = publisher
        self._generation_s = 0.0

    @property
    def servers_gone(self) -> bool:
        """A publish failed after a stop was asked: the step ends without the servers (no eval)."""
        return self.publisher.servers_gone

    def next_batch(self, state: DriverState, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        raise NotImplementedError

    def publish(self, version: int) -> dict[str, float]:
        """The trainer now holds ``version``: the servers serve it, or its lagged predecessor (a
        failure after a stop was asked ends the step without them: the publisher's stop rule)."""
        return self.publisher.publish(version)

    def evaluate(self, step: int) -> dict[str, float]:
        if self.servers_gone:
            return {}
        return evaluate(self.ctx, step, format_version(self.publisher.version), self.publisher.restore)

    def evaluate_exact(self, step: int) -> dict[str, float]:
        """The exact metric J after ``step`` steps, when ``training.exact_eval_interval`` says so."""
        if self.servers_gone:  # every rank alike: the stopped sync was raised on each
            return {}
        return evaluate_exact(self.ctx, step)

    def step_metrics(self, step_s: float, wait_s: float) -> dict[str, float]:
        """Each side's idle fraction over a step of ``step_s`` seconds, ``wait_s`` of them spent
        waiting for the batch."""
        return {"time/trainer_idle": wait_s / max(step_s, 1e-9)}

    def checkpoint_into(self, state: DriverState) -> None:
        """Record the producer's position in ``state`` before a checkpoint."""

    def save_checkpoint(self, state: DriverState) -> Path | None:
        """Every rank: checkpoint the run at ``state.step``, with the producer's position and the
        served weight sets (:func:`megatron_acrl.run.resume.save_checkpoint`)."""
        self.checkpoint_into(state)
        return save_checkpoint(self.ctx, state, self.publisher)

    def close(self) -> None:
        """Stop generating (safe to call twice)."""


class SyncProducer(Producer):
    """Generate the step's batch when the loop asks (:func:`megatron_acrl.rollout.phase.collect_rollouts`)."""

    def next_batch(self, state: DriverState, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        t = time.perf_counter()
        out = collect_rollouts(self.ctx, state, step, self.publisher.restore)
        self._generation_s = time.perf_counter() - t
        return out

    def step_metrics(self, step_s: float, wait_s: float) -> dict[str, float]:
        # The servers work only while the step generates.
        m = super().step_metrics(step_s, wait_s)
        m["time/server_idle"] = max(0.0, 1.0 - self._generation_s / max(step_s, 1e-9))
        return m


class AsyncProducer(Producer):
    """Take finished groups from rank 0's generation engine (module doc)."""

    def __init__(self, ctx: RunContext, publisher: WeightPublisher, state: DriverState):
        super().__init__(ctx, publisher)
        r, a = ctx.cfg.rollout, ctx.cfg.algorithm
        self.drain_updates = not r.partial_rollouts and r.pause_mode != "abort"
        self.engine: GenerationEngine | None = None
        self._busy: list[float] = []
        self._t_last = time.perf_counter()
        if ctx.rank != 0:
            return
        assert ctx.prompt_stream is not None
        position = state.producer or {}
        queue = GroupQueue(
            batch_groups=r.prompts_per_step,
            max_staleness=r.max_staleness,
            policy=r.stale_policy,
            dynamic_sampling=a.dynamic_sampling,
            refill_groups=a.max_refill_rounds * r.prompts_per_step,
            next_step=state.step,
        )
        pending = [(int(g), Prompt(t, ans, int(uid))) for g, t, ans, uid in position.get("pending", [])]
        source = PromptSource(ctx.prompt_stream, state.prompts_consumed, position.get("next_gid", 0), pending)
        self.engine = GenerationEngine(ctx, queue, source, publisher.version)
        self.engine.start()
        self._busy = self.engine.busy_seconds()

    def next_batch(self, state: DriverState, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Step ``step``'s batch; a server found dead or hung, or a dead router, is repaired, the
        served weights re-sent, the lost requests resubmitted, and the wait goes on (up to
        ``ATTEMPTS`` repairs a step)."""
        batch, metrics = vote(
            lambda attempt: self._take(step, attempt == ATTEMPTS) if self.engine is not None else NO_VERDICT,
            attempts=ATTEMPTS + 1,
            recover=lambda attempt, why: self._restart(step, why),
            failed=lambda why, exhausted: f"rollout of step {step + 1} failed: {why}",
            stopped=lambda why: stopped_message(step, why),
        )
        metrics.update(rollout_metrics(batch))
        metrics.update(recovery_metrics(self.ctx))
        return batch, metrics

    def _restart(self, step: int, why: str) -> None:
        """Every rank, after rank 0 repaired the servers (:meth:`_take`): every rank re-sends the
        served weights, and the engine resubmits what was lost."""
        log0(f"step {step + 1}: rollout failed ({why}); re-sending the served weights, resubmitting requests")
        self.publisher.restore()  # every rank: the restarted server gets the served weights
        if self.engine is not None:
            self.engine.restored()

    def _take(self, step: int, last: bool) -> Verdict:
        """Rank 0: wait for the engine: ``(OK, (batch, metrics))``; after failed requests, ``(RETRY,
        why)`` once the servers are repaired, ``(ERROR, why)`` when nothing was found to repair (or
        on the ``last`` try), or ``(STOPPED, why)`` when a stop was asked
        (:mod:`megatron_acrl.world.vote`)."""
        assert self.engine is not None
        try:
            kind, taken = self.engine.wait_batch(step)
        except Exception as e:  # noqa: BLE001 - told to every rank, then raised
            return (STOPPED if self.ctx.stopping() else ERROR), f"{type(e).__name__}: {e}"
        if kind == "failed":
            return self._repair(taken, last)
        batch = RolloutBatch.concat([g.batch for g in taken.groups], self.ctx.pad_id)  # type: ignore[misc]
        if self.ctx.args.save_rollouts:
            save_rollouts(batch, self.ctx.args.save_rollouts, step)
        metrics = self.engine.stats()
        metrics["rollout/topped_up_groups"] = float(taken.topped_up)
        return OK, (batch, metrics)

    def _repair(self, why: str, last: bool) -> Verdict:
        """Rank 0, after the engine's requests failed with ``why``: the verdict, with the servers
        repaired before a RETRY (:meth:`~megatron_acrl.servers.recovery.ServerRecovery.recover_rollout`)."""
        assert self.engine is not None
        if self.ctx.stopping():
            return STOPPED, why
        if last or self.ctx.servers is None or self.engine.failed_with is None:
            return ERROR, why
        try:
            done = self.ctx.servers.recover_rollout(self.engine.failed_with)
        except Exception as e:  # noqa: BLE001 - a repair that failed ends the run on every rank
            return ERROR, f"{why}; the repair failed: {type(e).__name__}: {e}"
        return (ERROR, why) if done is None else (RETRY, f"{why}; {done}")

    def publish(self, version: int) -> dict[str, float]:
        """Push the update while the requests in flight pause (or, without partial rollouts, after
        they finish); admission continues on the new version."""
        if self.engine is not None:
            self.engine.begin_update(drain=self.drain_updates)
        try:
            return self.publisher.publish(version)
        finally:
            if self.engine is not None:
                self.engine.end_update(self.publisher.version, drained=self.drain_updates)

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate with nothing of training's in flight: its pushes (trainer weights) never reach a
        training sample."""
        if self.servers_gone:
            return {}
        return self._holding(super().evaluate, step)

    def evaluate_exact(self, step: int) -> dict[str, float]:
        if self.servers_gone or not exact_due(self.ctx.cfg, step):
            return {}
        return self._holding(super().evaluate_exact, step)

    def _holding(self, fn: Callable[[int], dict[str, float]], step: int) -> dict[str, float]:
        if self.engine is not None:
            self.engine.hold()
        try:
            return fn(step)
        finally:
            if self.engine is not None:
                self.engine.release()

    def step_metrics(self, step_s: float, wait_s: float) -> dict[str, float]:
        m = super().step_metrics(step_s, wait_s)
        if self.engine is not None:
            busy, now = self.engine.busy_seconds(), time.perf_counter()
            span = max(now - self._t_last, 1e-9)
            if len(busy) == len(self._busy):
                per = [(b - a) / span for a, b in zip(self._busy, busy, strict=True)]
                m["time/server_idle"] = max(0.0, 1.0 - sum(per) / len(per))
            self._busy, self._t_last = busy, now
        return m

    def checkpoint_into(self, state: DriverState) -> None:
        """The stream position, the next group id and the admitted, untrained groups (rank 0); a
        resume generates those again, first."""
        if self.engine is None:
            return
        position = self.engine.snapshot()
        state.prompts_consumed = position.pop("prompts_consumed")
        state.producer = position

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def make_producer(ctx: RunContext, state: DriverState, step_dir: Path | None) -> Producer:
    """The run's producer, serving its first weights (the initial policy, or the checkpoint's)."""
    publisher = ctx.publisher
    assert publisher is not None, "setup_run attaches the publisher"
    publisher.start(state.weight_version, step_dir)
    if ctx.cfg.rollout.mode == "async":
        return AsyncProducer(ctx, publisher, state)
    return SyncProducer(ctx, publisher)
