"""The one fault protocol of the trainer world: rank 0 tries, its verdict is broadcast, every rank acts.

A rollout, a weight push and an async batch take all fail the same way: only rank 0 talks to the
servers, so only rank 0 knows what went wrong, and every rank must then do the same thing (retry
after a recovery, raise, or stop) or the next collective deadlocks. :func:`vote` is that protocol,
written once::

    value = vote(try_once, attempts=3, recover=recover, failed=failed, stopped=stopped)

``try_once(attempt)`` runs on every rank (collectives inside it are joined by all) and returns a
:data:`Verdict`; rank 0's is the one that counts:

* ``(OK, value)`` -- ``value`` (rank 0's, broadcast) is returned on every rank;
* ``(RETRY, why)`` -- ``recover(attempt, why)`` runs on every rank, then the next attempt; on the
  last attempt a :class:`RuntimeError` of ``failed(why, True)`` instead;
* ``(ERROR, why)`` -- a :class:`RuntimeError` of ``failed(why, False)`` on every rank (bad input:
  a retry would fail the same way);
* ``(STOPPED, why)`` -- :class:`StoppedWithoutServers` of ``stopped(why)`` on every rank: a stop was
  asked and then the servers failed (SLURM's preemption signals their step too), so nothing is
  recovered and the loop ends at a step boundary, which the run checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_acrl.world.distributed import broadcast_object

OK, RETRY, ERROR, STOPPED = "ok", "retry", "error", "stopped"
Verdict = tuple[str, Any]
"""``(OK | RETRY | ERROR | STOPPED, value or why)``; what non-zero ranks return is ignored."""

NO_VERDICT: Verdict = ("", None)
"""What a rank that does not decide returns from ``try_once``."""


class StoppedWithoutServers(Exception):
    """A stop was asked (SIGTERM / SIGINT), and then a rollout or a weight sync of the loop failed:
    SLURM's preemption signals every step of the job, the servers' too, so they go down under the
    trainer's feet. Raised on every rank alike (rank 0 decides), instead of restarting servers that
    are going down with the job; the loop then ends at a step boundary, which the run checkpoints."""


def vote(
    try_once: Callable[[int], Verdict],
    *,
    attempts: int,
    recover: Callable[[int, Any], None],
    failed: Callable[[Any, bool], str],
    stopped: Callable[[Any], str],
) -> Any:
    """Run the protocol of the module doc on every rank; returns rank 0's value of the first OK."""
    for attempt in range(attempts):
        kind, value = broadcast_object(try_once(attempt))
        if kind == OK:
            return value
        if kind == STOPPED:
            raise StoppedWithoutServers(stopped(value))
        if kind == ERROR:
            raise RuntimeError(failed(value, False))
        if kind != RETRY:
            raise RuntimeError(f"rank 0 gave no verdict ({kind!r}); the fault protocol needs one")
        if attempt == attempts - 1:
            raise RuntimeError(failed(value, True))
        recover(attempt, value)
    raise RuntimeError("vote: attempts must be >= 1")
