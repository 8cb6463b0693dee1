"""The async producer's engine on rank 0: a thread with its own event loop that keeps the servers
generating while the trainer trains.

It admits prompts as the staleness bound allows (:class:`~megatron_acrl.rollout.group_queue.GroupQueue`),
sends their samples in batched requests through the rollout backend
(:meth:`~megatron_acrl.rollout.backend.RolloutBackend.generate_async`: the servers' one dispatch
path, which picks the least loaded server, or sends through sglang-router with ``rollout.router:
sglang``), scores each group as its last sample returns and hands it to the queue, from which the
trainer's thread takes a step's batch (:meth:`GenerationEngine.wait_batch`). Requests keep running
across weight updates: the synchronizer pauses the servers (``rollout.pause_mode``), loads the new
weights and continues, and SGLang records which output tokens each version produced.

Faults: a request that fails is kept, and the engine stops admitting and sending; the trainer's
thread finds what failed (a dead or hung server, a dead router:
:meth:`~megatron_acrl.rollout.backend.RolloutBackend.recover_rollout`, :attr:`failed_with` is the
first error), repairs it and re-sends the served weights (:meth:`restored`), then the engine
resubmits exactly the samples that were lost, so nothing is lost and no group is trained twice;
when nothing is found wrong the error is fatal there (a bad answer, a prompt too long). A sample
the servers abort (``pause_mode: abort``) is generated again from scratch on the new weights. A
failure to score is fatal and raised in the trainer's thread.

Agents (``rollout.agent``): each sample is a trajectory that the engine's loop runs as a task of its
own (:class:`~megatron_acrl.rollout.trajectories.AgentRunner`), its turns sent through a
:class:`TurnGate`. A trajectory may span weight versions: an update between two turns (a tool call
in flight meanwhile) or inside one (the turn paused and continued) is recorded per generated token.
Each turn waits while the engine holds (an evaluation, a draining update, a lost server), and is sent
and counted in flight under the engine's lock, so a hold never misses a turn about to go. The
staleness bound holds per generated token: the queue computes a group's oldest version from its
tokens, and a trajectory whose oldest generated token can no longer be trained within
``rollout.max_staleness`` (``stale_policy: drop``) is stopped at its next turn and generated again
from scratch (``async/regenerated_trajectories``). A trajectory lost with its server is generated
again from its prompt; an aborted turn is sent again by its session.

Shared state is guarded by one condition variable; the loop thread never awaits while holding it.
The thread runs on ``rollout.producer_cpus`` when given (set on it alone, before it does any work),
so that its CPU work does not take the trainer's cores.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from megatron_acrl.algo.advantages import dynamic_sampling_keep
from megatron_acrl.config import ConfigError
from megatron_acrl.rollout.agent.session import AgentSession, Trajectory, TrajectoryEnd
from megatron_acrl.rollout.backend import RolloutBackend, Sample
from megatron_acrl.rollout.group_queue import GroupQueue
from megatron_acrl.rollout.phase import encode_prompts, score_groups, shape_rewards
from megatron_acrl.rollout.trajectories import AgentRunner, trajectories_batch, trajectory_versions
from megatron_acrl.tasks.base import Prompt
from sglang_bridge.samples import SamplingParams

if TYPE_CHECKING:
    from megatron_acrl.run.context import RunContext

MAX_ABORTS = 10
"""A sample the servers abort this often in a row is an error, not a weight update."""

GATE_POLL_S = 0.01
"""How often a turn waiting for a hold to end looks again."""

Slot = tuple[int, int]  # (group id, sample index)


class PromptSource:
    """Prompts in admission order: the groups a resumed run regenerates first, then the stream."""

    def __init__(
        self, stream: Iterator[Prompt], position: int, next_gid: int, pending: list[tuple[int, Prompt]]
    ):
        self.stream = stream
        self.position = position
        """Prompts drawn from the stream so far (``DriverState.prompts_consumed``)."""
        self.next_gid = next_gid
        self.pending = list(pending)

    def next(self) -> tuple[int, Prompt]:
        if self.pending:
            return self.pending.pop(0)
        prompt = next(self.stream)
        self.position += 1
        self.next_gid += 1
        return self.next_gid - 1, prompt


class BusyClock:
    """Per dispatch target (a server, or the router): seconds with a request in flight and the
    servers not paused for a weight update."""

    def __init__(self, n: int):
        self.total = [0.0] * n
        self.since: list[float | None] = [None] * n

    def update(self, busy: list[bool]) -> None:
        now = time.perf_counter()
        for i, b in enumerate(busy):
            if b and self.since[i] is None:
                self.since[i] = now
            elif not b and self.since[i] is not None:
                self.total[i] += now - self.since[i]  # type: ignore[operator]
                self.since[i] = None

    def read(self) -> list[float]:
        now = time.perf_counter()
        return [t + (now - s if s is not None else 0.0) for t, s in zip(self.total, self.since, strict=True)]


class TurnGate:
    """The backend an async agent session sends its turns through (module doc): the engine's gate
    in front of the servers' :meth:`~megatron_acrl.rollout.backend.RolloutBackend.generate_async`."""

    def __init__(self, engine: GenerationEngine):
        self.engine = engine
        self.session: AgentSession | None = None

    def generate_async(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *, affinity: str | None = None
    ) -> asyncio.Future[list[Sample]]:
        assert self.session is not None
        return asyncio.ensure_future(self.engine.send_turn(self.session, prompt_ids, params, affinity))

    def unpin(self, affinity: str) -> None:
        """The trajectory ended: the servers forget its affinity key."""
        unpin = getattr(self.engine.servers, "unpin", None)
        if unpin is not None:
            unpin(affinity)


class GenerationEngine:
    """Rank 0's generation thread (module doc). The trainer's thread calls the public methods."""

    def __init__(self, ctx: RunContext, queue: GroupQueue, prompts: PromptSource, served_version: int):
        assert ctx.servers is not None
        self.ctx, self.cfg, self.queue, self.prompts = ctx, ctx.cfg, queue, prompts
        self.servers: RolloutBackend = ctx.servers
        self.params = self.servers.sampling_params()
        self.cond = threading.Condition()
        self.served_version = served_version
        self.held = 0
        """Holds on admission (an evaluation, a weight update without partial rollouts)."""
        self.paused = False
        self.error: BaseException | None = None
        self.failure: str | None = None
        """Why requests failed; cleared by :meth:`restored`."""
        self.failed_with: BaseException | None = None
        """The error of :attr:`failure`, for the trainer's thread to diagnose."""
        self.restarts_seen = self.servers.restarts
        self.lost: list[Slot] = []  # failed with their server: resubmitted after the restart
        self.aborted: list[Slot] = []  # aborted by the servers: generated again
        self.aborts: dict[Slot, int] = {}
        self.samples: dict[int, list[Any]] = {}
        """Per live group, its finished samples (or trajectories) by index; None: not yet."""
        self.ids: dict[int, list[int]] = {}
        self.clock = BusyClock(len(self.servers.in_flight()))
        a = self.cfg.rollout.agent
        self.agents = AgentRunner(ctx) if a.agent is not None or a.env is not None else None
        """Agent trajectories instead of single completions (module doc)."""
        self.attempts: dict[Slot, int] = {}
        self.regenerated = 0
        """Trajectories stopped as too stale and generated again, over the run."""
        self._closing = False
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._pinned = threading.Event()
        self._pin_error: str | None = None

    # -- the trainer's thread -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread; a ``rollout.producer_cpus`` it cannot run on is a ConfigError here."""
        self._thread.start()
        self._pinned.wait()
        if self._pin_error is not None:
            self._thread.join(timeout=60)
            raise ConfigError([("rollout.producer_cpus", self._pin_error)])

    def wait_batch(self, step: int) -> tuple[str, Any]:
        """Block until step ``step``'s groups are ready: ``("ok", TakeResult)``, or ``("failed", why)``
        when requests failed (:attr:`failed_with` says with what; the caller repairs the servers, or
        finds the error fatal). A fatal error of the engine is raised here."""
        with self.cond:
            while True:
                if self.error is not None:
                    raise RuntimeError(f"the rollout producer failed: {self.error!r}") from self.error
                if self.failure is not None:
                    if self.servers.restarts == self.restarts_seen:
                        return "failed", self.failure
                    self._restored_locked()  # a weight push restarted the servers meanwhile
                taken = self.queue.take(step)
                if taken is not None:
                    self._poke()  # their places are free: admit more
                    return "ok", taken
                self.cond.wait(timeout=1.0)

    def begin_update(self, drain: bool) -> None:
        """A weight update starts (``drain``: first let every request in flight finish)."""
        with self.cond:
            if drain:
                self._hold_locked(drain=True)
            self.paused = True
            self._tick()

    def end_update(self, served_version: int, drained: bool) -> None:
        """The servers now serve ``served_version``; admission continues."""
        with self.cond:
            self.served_version = served_version
            self.paused = False
            if drained:
                self.held -= 1
            if self.failure is not None and self.servers.restarts != self.restarts_seen:
                self._restored_locked()
            self._tick()
            self._poke()

    def hold(self) -> None:
        """Stop admitting and wait until nothing is in flight (before an evaluation)."""
        with self.cond:
            self._hold_locked(drain=True)

    def release(self) -> None:
        with self.cond:
            self.held -= 1
            self._poke()

    def restored(self) -> None:
        """The failed servers are restarted and serve the served weights again: resubmit."""
        with self.cond:
            self._restored_locked()

    def snapshot(self) -> dict[str, Any]:
        """The producer's position: prompts drawn, next group id, the admitted untrained groups."""
        with self.cond:
            pending = [(g.gid, g.prompt) for g in self.queue.pending()] + self.prompts.pending
            return {
                "prompts_consumed": self.prompts.position,
                "next_gid": self.prompts.next_gid,
                "pending": [[gid, p.text, p.answer, p.uid] for gid, p in sorted(pending, key=lambda x: x[0])],
            }

    def stats(self) -> dict[str, float]:
        """Queue depth (finished groups waiting), groups in flight, stale groups dropped and stale
        trajectories regenerated so far."""
        with self.cond:
            ready = len(self.queue.ready())
            return {
                "async/queue_depth": float(ready),
                "async/in_flight_groups": float(len(self.queue.live) - ready),
                "async/dropped_stale_groups": float(self.queue.dropped_stale),
                "async/regenerated_trajectories": float(self.regenerated),
            }

    def busy_seconds(self) -> list[float]:
        """Per server, seconds so far with requests in flight outside weight updates."""
        with self.cond:
            return self.clock.read()

    def close(self) -> None:
        with self.cond:
            self._closing = True
            self.cond.notify_all()
        if self._thread.is_alive():
            self._poke()
            self._thread.join(timeout=60)

    # -- shared helpers (called with the lock held) -------------------------------------------------

    def _hold_locked(self, drain: bool) -> None:
        self.held += 1
        while drain and self._busy() and self.error is None and self.failure is None:
            self.cond.wait(timeout=1.0)

    def _restored_locked(self) -> None:
        self.restarts_seen = self.servers.restarts
        self.failure = self.failed_with = None
        self._poke()

    def _busy(self) -> bool:
        """Whether a request is in flight (the backend counts it from the moment it is sent)."""
        return any(self.servers.in_flight().values())

    def _tick(self) -> None:
        self.clock.update([bool(n) and not self.paused for n in self.servers.in_flight().values()])

    def _poke(self) -> None:
        if self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    # -- the engine's thread -------------------------------------------------------------------------

    def _pin(self) -> bool:
        """Move this thread (only: ``sched_setaffinity(0)`` is the calling thread) to the producer's
        cores; False, with the reason kept for :meth:`start`, when it cannot run there."""
        cpus = self.cfg.rollout.producer_cpus
        try:
            if cpus:
                os.sched_setaffinity(0, cpus)
        except (OSError, ValueError, AttributeError) as e:  # AttributeError: not Linux
            self._pin_error = (
                f"the producer thread cannot run on cores {list(cpus)} ({e}); this process may use "
                f"{sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'}: "
                "give cores of the machine (and of the job's cpuset), or [] for the trainer's cores"
            )
        self._pinned.set()
        return self._pin_error is None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        if not self._pin():
            self._loop.close()
            return
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._wake = asyncio.Event()
        try:
            while not self._closing:
                self._submit(self._work())
                await self._wake.wait()
                self._wake.clear()
        finally:
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.servers.aclose()

    def _work(self) -> list[Slot]:
        """Samples to send now: lost ones after a restart, aborted ones, newly admitted groups."""
        with self.cond:
            if self._closing or self.error is not None or self.failure is not None:
                return []
            work, self.lost, self.aborted = self.lost + self.aborted, [], []
            if self.held:
                return work
            try:
                r = self.cfg.rollout
                for _ in range(self.queue.capacity(self.served_version)):
                    gid, prompt = self.prompts.next()
                    # an agent renders its own prompt (its env's conversation): nothing to encode here
                    ids = (
                        encode_prompts(self.ctx.tokenizer, [prompt], r.max_prompt_len)[0]
                        if self.agents is None
                        else []
                    )
                    self.ids[gid] = ids
                    self.queue.admit(gid, prompt, self.served_version)
                    self.samples[gid] = [None] * r.n_samples_per_prompt
                    work += [(gid, j) for j in range(r.n_samples_per_prompt)]
            except Exception as e:  # noqa: BLE001 - fatal, raised in the trainer's thread
                self.error = e
                self.cond.notify_all()
            return work

    def _submit(self, work: list[Slot]) -> None:
        if self.agents is not None:
            for slot in work:
                self._spawn(self._trajectory(slot))
            return
        per = self.cfg.rollout.samples_per_request
        for lo in range(0, len(work), per):
            chunk = work[lo : lo + per]
            # Sent (and counted in flight by the backend) now: a hold that waits for nothing in
            # flight never misses a request whose task has not started yet.
            sent = self.servers.generate_async([self.ids[gid] for gid, _ in chunk], self.params)
            with self.cond:
                self._tick()
            self._spawn(self._request(sent, chunk))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _request(self, sent: asyncio.Future[list[Sample]], chunk: list[Slot]) -> None:
        """Wait for one batched request of ``chunk``; its samples go to their groups."""
        try:
            out = await sent
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a server gone (resubmit after restart) or fatal
            self._failed(chunk, e)
            return
        finally:
            with self.cond:
                self._tick()
                self.cond.notify_all()
        try:
            for slot, sample in zip(chunk, out, strict=True):
                self._place(slot, sample)
        except Exception as e:  # noqa: BLE001 - scoring failed: fatal
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _failed(self, chunk: list[Slot], e: Exception) -> None:
        """A request failed: keep its samples for after the repair; the trainer's thread decides
        (module doc) whether anything is to repair, from the first error (a hung server shows as a
        timeout, or through the router as an HTTP error, with no process dead)."""
        with self.cond:
            self.lost += chunk
            if self.failure is None:
                self.failure = f"{type(e).__name__}: {e}"
                self.failed_with = e
            self.cond.notify_all()

    def _place(self, slot: Slot, sample: Sample) -> None:
        gid, j = slot
        if sample.finish_reason == "abort":
            self.aborts[slot] = self.aborts.get(slot, 0) + 1
            if self.aborts[slot] > MAX_ABORTS:
                raise RuntimeError(f"group {gid} sample {j} was aborted {MAX_ABORTS} times by the servers")
            with self.cond:
                self.aborted.append(slot)
            self._poke()
            return
        self._keep(slot, sample)

    def _keep(self, slot: Slot, result: Sample | Trajectory) -> None:
        gid, j = slot
        self.aborts.pop(slot, None)
        slots = self.samples[gid]
        slots[j] = result
        if all(s is not None for s in slots):
            self._finish_group(gid)

    # -- agent trajectories (module doc) ------------------------------------------------------------

    async def _trajectory(self, slot: Slot) -> None:
        """Run one agent trajectory of ``slot``; it goes to its group, or is generated again (lost
        with its server, or too stale)."""
        gid, j = slot
        assert self.agents is not None
        with self.cond:
            prompt = self.queue.live[gid].prompt
            self.attempts[slot] = attempt = self.attempts.get(slot, 0) + 1
        gate = TurnGate(self)
        # a fresh affinity key per attempt: a regenerated trajectory starts anew on any server
        session = self.agents.session(f"g{gid}-s{j}-a{attempt}", backend=gate, abort_retries=MAX_ABORTS)
        gate.session = session
        try:
            traj = await self.agents.run(session, prompt)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - its server is gone (resubmitted after the restart) or fatal
            self._failed([slot], e)
            return
        if session.stale:
            with self.cond:
                self.regenerated += 1
                self.aborted.append(slot)
            self._poke()
            return
        try:
            with self.cond:
                self.attempts.pop(slot, None)
            self._keep(slot, traj)
        except Exception as e:  # noqa: BLE001 - scoring failed: fatal
            with self.cond:
                self.error = e
                self.cond.notify_all()

    async def send_turn(
        self,
        session: AgentSession,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        affinity: str | None,
    ) -> list[Sample]:
        """One turn of ``session`` (:class:`TurnGate`): wait while the engine holds, stop a trajectory
        too stale to train, else send it, checked and counted in flight under the lock."""
        while True:
            with self.cond:
                if self._too_stale(session.traj):
                    session.stale = True
                    raise TrajectoryEnd(
                        "stale", "its oldest generated token is older than rollout.max_staleness"
                    )
                if not self.held and self.failure is None and self.error is None:
                    sent = self.servers.generate_async(prompt_ids, params, affinity=affinity)
                    self._tick()
                    break
            await asyncio.sleep(GATE_POLL_S)
        try:
            return await sent
        finally:
            with self.cond:
                self._tick()
                self.cond.notify_all()

    def _too_stale(self, traj: Trajectory) -> bool:
        """Whether the oldest generated token of ``traj`` is older than K at the next step that can
        train it (never with ``stale_policy: wait``, whose admission keeps every group in time)."""
        versions = [v for v in trajectory_versions(traj) if v >= 0]
        return bool(versions) and self.queue.next_step - min(versions) > self.queue.max_staleness

    def _finish_group(self, gid: int) -> None:
        """Score a complete group (reward, DAPO shaping and filter) and hand it to the queue."""
        with self.cond:
            prompt = self.queue.live[gid].prompt
        if self.agents is not None:  # rewarded by their env / agent as they ended
            n = len(self.samples[gid])
            b = trajectories_batch(self.ctx, self.samples[gid], [prompt.text] * n, [gid] * n)
        else:
            b = score_groups(
                self.ctx.task,
                self.ctx.tokenizer,
                [prompt],
                [self.ids[gid]],
                [self.samples[gid]],
                pad_id=self.ctx.pad_id,
                eos_id=self.ctx.eos_id,
                first_group_id=gid,
                with_versions=True,
            )
        b = shape_rewards(b, self.ctx)
        keep = True
        if self.cfg.algorithm.dynamic_sampling:
            keep = bool(dynamic_sampling_keep(b.rewards, b.group_ids).all())
        with self.cond:
            self.queue.finish(gid, b, keep=keep)
            del self.samples[gid], self.ids[gid]
            self.cond.notify_all()
        if not keep:
            self._poke()  # its place is free
