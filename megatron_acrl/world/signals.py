"""SIGTERM and SIGINT, owned by the entry point (``megatron_acrl.train.run``, the study's ``main``).

Nothing installs a handler at import time, and the bridge installs none: the entry point enters
:func:`stop_on_signals` once, around everything it runs. The first SIGTERM or SIGINT only asks for
a stop (:attr:`StopSignals.requested`), which the loop acts on at its next boundary: the trainer at
the end of the step (checkpoint, exit 0: what SLURM's preemption signal expects), the study before
its next run. A second one raises :class:`Interrupted` in the main thread, so the entry point
unwinds through its ``finally`` blocks at once.

Leaving the block -- normally, by an exception, or by :class:`Interrupted` -- asks the bridge's
registry to stop every SGLang server this process started
(:func:`sglang_bridge.server.stop_all_servers`), then puts the previous handlers back. The handler
itself never touches the registry (it sets a flag or raises), so it cannot cut into the registry's
own bookkeeping, and a signal that arrives during that clean-up is noted, not acted on.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from sglang_bridge.server import stop_all_servers

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """A second stop signal: stop now. A BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` (the server-fault retries) mistakes it for a fault and carries on."""

    def __init__(self, signum: int, checkpointed_step: int | None = None):
        self.signum = signum
        self.checkpointed_step = checkpointed_step
        """The step the run had checkpointed before this signal (None: the current step is not
        checkpointed): a signal during the clean-up of a checkpointed stop loses nothing."""
        super().__init__(f"interrupted by a second {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by this signal (128 + N)."""
        return 128 + self.signum


class StopSignals:
    """What the entry point's handlers saw: the first stop signal, and whether it is cleaning up."""

    def __init__(self) -> None:
        self.signum: int | None = None
        """The first stop signal received (None: none yet)."""
        self.closing = False
        """Set while the entry point cleans up: further signals are only noted."""
        self.checkpointed_step: int | None = None
        """Set by the entry point once the current step is checkpointed: a later signal still
        interrupts the clean-up, but says the stop lost nothing (see :class:`Interrupted`)."""

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        """The handler: note the first signal; raise :class:`Interrupted` on the next."""
        if self.signum is None:
            self.signum = signum
        elif not self.closing:
            raise Interrupted(signum, self.checkpointed_step)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopSignals]:
    """Install the stop handlers for the block (see module doc); yields their :class:`StopSignals`.

    Handlers can only be set from the main thread; elsewhere (a test calling the entry point from a
    worker thread) the block runs with the process's handlers as they are, and still cleans up.
    """
    stop = StopSignals()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, stop.handle) for sig in STOP_SIGNALS}
    try:
        yield stop
    finally:
        stop.closing = True
        try:
            stop_all_servers()
        finally:
            for sig, handler in previous.items():
                if handler is not None:  # None: set outside Python, cannot be put back from here
                    signal.signal(sig, handler)
