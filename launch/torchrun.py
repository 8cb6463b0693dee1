"""``torchrun`` whose TCP stores listen only where its ranks dial them, and that stops like a rank.

    python -m launch.torchrun --standalone --nproc-per-node 2 -m megatron_acrl.train --config ...
    python -m launch.torchrun --nnodes 4 --node-rank $N --master-addr node1 --master-port P ...

Same arguments as ``python -m torch.distributed.run``, plus ``--ranks-get-stop-signals`` (below).

Stores. torch's agent hosts two stores (the rendezvous store and the one its ranks bootstrap from)
and each ``TCPStore`` server listens on every interface, whatever address it is reached at. Here the
agent builds them as :class:`sglang_bridge.listeners.BoundTCPStore`: bound to that address only,
loopback for ``--standalone`` (the ranks' store is announced at ``--local-addr``, 127.0.0.1 unless
given), the master's interface in a multi-node job. The ranks themselves only dial the agent's store.

Stopping. SIGTERM to this process (``kill``, a scheduler, ``docker stop``) or Ctrl-C on its process
group is forwarded by the agent to every rank's process group; each rank's entry point
(:mod:`megatron_acrl.world.signals`) then finishes its step, checkpoints and exits 0. The agent waits
``--shutdown-timeout`` seconds for that before it SIGKILLs the ranks: torch's 30 s default is often
shorter than a step plus a save, so this launcher defaults it to :data:`STOP_GRACE_S` (bounded: a
rank that hangs is still killed). When every rank exited 0 after the stop, this process exits 0
too (torch's agent re-raises the signal as an error, exit 1), so a requeueing scheduler sees a clean
stop. When the ranks refused their config or inputs (each printed the key and the fix and exited 2;
the agent stops the rest), this process exits 2 too, without torch's ChildFailedError traceback;
the same when rank 0 alone refused after start-up (a held server port, an unreachable server: exit
69, or 2) and the other ranks followed it with its code
(:func:`megatron_acrl.world.distributed.share_refusal`). A second signal to the agent forwards a
second one to the ranks: they stop at once, no checkpoint of the step (exit 128 + N).

Under SLURM (``ProctrackType=proctrack/linuxproc`` or ``cgroup``) ``scancel --signal`` and
preemption signal every process of the step, the ranks included: a forwarded copy would be each
rank's *second* signal. ``--ranks-get-stop-signals`` (set by the job script) makes the agent forward
nothing on SIGTERM / SIGINT and keep watching the ranks, which stop on their own signal.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from types import FrameType

from megatron_acrl.config.exit_codes import CONFIG_ERROR, SERVERS_UNAVAILABLE, describe

STOP_GRACE_S = 300
"""Default ``--shutdown-timeout``: seconds the agent gives the ranks to finish their step and its
checkpoint after a stop signal, before it SIGKILLs them."""

RANKS_GET_SIGNALS = "--ranks-get-stop-signals"


def bind_agent_stores() -> None:
    """Make this process's torchrun agent build its stores as ``BoundTCPStore`` (the launcher's own
    process only: called by :func:`main`, never at import)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    from sglang_bridge.listeners import BoundTCPStore

    dist.TCPStore = BoundTCPStore  # type: ignore[misc]  # dynamic_rendezvous: the ranks' store
    c10d_rendezvous_backend.TCPStore = BoundTCPStore  # type: ignore[misc]  # --standalone / c10d
    static_tcp_rendezvous.TCPStore = BoundTCPStore  # type: ignore[misc]  # --master-addr


def standalone_args(argv: list[str]) -> list[str]:
    """``argv`` with ``--local-addr 127.0.0.1`` added for a ``--standalone`` run that names none:
    the ranks' store is then announced, and bound, on loopback rather than at the host's name."""
    flags = [a.split("=", 1)[0] for a in argv]
    if "--standalone" in flags and not {"--local-addr", "--local_addr"} & set(flags):
        return ["--local-addr", "127.0.0.1", *argv]
    return argv


def _launcher_part(argv: list[str]) -> int:
    """How many leading items of ``argv`` are torchrun's own (the rest: the script and its args),
    as torch's own parser splits them."""
    from torch.distributed import run

    ns = run.parse_args(argv)
    return len(argv) - 1 - len(ns.training_script_args)


def stop_args(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` with ``--shutdown-timeout STOP_GRACE_S`` added unless given, and without this
    launcher's own ``--ranks-get-stop-signals``; and whether that flag was there."""
    own = False
    if RANKS_GET_SIGNALS in argv:
        i = argv.index(RANKS_GET_SIGNALS)
        rest = argv[:i] + argv[i + 1 :]
        if i <= _launcher_part(rest):  # ours, not the training script's
            argv, own = rest, True
    head = argv[: _launcher_part(argv)]
    if not any(a.split("=", 1)[0] in ("--shutdown-timeout", "--shutdown_timeout") for a in head):
        argv = ["--shutdown-timeout", str(STOP_GRACE_S), *argv]
    return argv, own


class WorkerExits:
    """The ranks' exit codes as the agent saw them when it closed them (after a stop signal)."""

    def __init__(self) -> None:
        self.codes: dict[int, int | None] = {}

    @property
    def all_clean(self) -> bool:
        return bool(self.codes) and all(code == 0 for code in self.codes.values())

    def record(self) -> None:
        """Wrap the agent's close of its rank processes to note their exit codes (None: running)."""
        from torch.distributed.elastic.multiprocessing import api

        close = api.SubprocessContext._close

        def _close(ctx: api.SubprocessContext, death_sig: signal.Signals, timeout: int = 30) -> None:
            close(ctx, death_sig, timeout)
            self.codes.update({r: h.proc.poll() for r, h in ctx.subprocess_handlers.items()})

        api.SubprocessContext._close = _close  # type: ignore[method-assign]


def _note_only(signum: int, _frame: FrameType | None) -> None:
    print(
        f"launch.torchrun: {signal.Signals(signum).name} received; the ranks received it too and "
        "stop after their step's checkpoint",
        file=sys.stderr,
        flush=True,
    )


def keep_stop_signals_from_the_ranks() -> None:
    """``--ranks-get-stop-signals``: the agent's SIGTERM / SIGINT only note (see module doc). Its
    handlers are installed when it starts the ranks, so replace them there."""
    from torch.distributed.elastic.multiprocessing import api

    start: Callable[[api.PContext], None] = api.PContext.start

    def _start(ctx: api.PContext) -> None:
        start(ctx)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _note_only)

    api.PContext.start = _start  # type: ignore[method-assign]


_AGENT_STOPS = (-signal.SIGTERM, -signal.SIGKILL)
"""Exit codes of a rank the agent stopped because another failed (SIGTERM, SIGKILL after the
shutdown timeout), as ``Popen`` reports them."""


REFUSALS = (CONFIG_ERROR, SERVERS_UNAVAILABLE)
"""Exit codes of a rank that refused the run with a message of its own (the key and the fix, or the
server that is unavailable and why): passed on by the launcher, no traceback."""


def refused_exit_code(failures: dict[int, int]) -> int | None:
    """The code to exit with when the ranks refused their input (``failures``: global rank -> exit
    code of each rank that failed): a code of :data:`REFUSALS` when every failed rank exited with
    that one code, or was only stopped by the agent after that (each refusing rank printed the
    key and the fix, or followed rank 0's refusal; torch's ChildFailedError traceback would only
    bury it), else None (a real failure: torch reports it)."""
    codes = list(failures.values())
    refused = {c for c in codes if c in REFUSALS}
    if len(refused) == 1 and all(c in refused or c in _AGENT_STOPS for c in codes):
        return refused.pop()
    return None


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    bind_agent_stores()
    args, ranks_get_signals = stop_args(standalone_args(list(sys.argv[1:] if argv is None else argv)))
    if ranks_get_signals:
        keep_stop_signals_from_the_ranks()
    exits = WorkerExits()
    exits.record()
    try:
        run.main(args)
    except ChildFailedError as e:
        code = refused_exit_code({r: f.exitcode for r, f in e.failures.items()})
        if code is None:
            raise
        print(
            f"launch.torchrun: the ranks refused the run (exit {code}: {describe(code)}; the message "
            "is above)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(code)
    except SignalException as e:
        if not exits.all_clean:
            raise
        print(
            f"launch.torchrun: stopped by {signal.Signals(e.sigval).name}; every rank checkpointed "
            "and exited 0",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    main()
