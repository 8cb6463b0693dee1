"""A child's whole process tree, read from ``/proc``: its descendants (also any that left its process
group), whether one of them is stopped, and a kill that reaches every one.

A server is stopped through its process group (``os.killpg``), which reaches every process SGLang
starts as long as none of them calls ``setsid``; the tree is collected *before* the kill because a
process whose parent died is re-parented (to init or a subreaper) and can no longer be found from
the server's pid. Linux only: elsewhere the tree is the main process alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

_PROC = Path("/proc")


Proc = tuple[int, int]
"""``(pid, start time)``: a process, told apart from a later one that reuses its pid."""


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, start time)`` of ``pid`` from ``/proc/<pid>/stat``, None when it is gone."""
    try:
        rest = (_PROC / str(pid) / "stat").read_text().rsplit(") ", 1)[1].split()
        return rest[0], int(rest[1]), int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[Proc]:
    """Every live descendant of ``pid`` (children first), zombies excluded."""
    children: dict[int, list[Proc]] = {}
    with contextlib.suppress(OSError):
        for entry in _PROC.iterdir():
            if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None and st[0] != "Z":
                children.setdefault(st[1], []).append((int(entry.name), st[2]))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p[0], []))
    return out


def same(proc: Proc) -> bool:
    """Whether ``proc`` still runs as the process it was (not exited, its pid not reused)."""
    st = _stat(proc[0])
    return st is not None and st[0] != "Z" and st[2] == proc[1]


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie waiting for its parent counts as gone)."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def stopped(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are stopped (SIGSTOP, SIGTSTP: state T) or stopped under a tracer (t)."""
    return [p for p in pids if (st := _stat(p)) is not None and st[0] in "Tt"]


def kill_tree(pgid: int, tree: list[Proc]) -> None:
    """SIGKILL the process group ``pgid`` and every process of ``tree`` that is still itself.

    SIGKILL is the one signal a stopped process acts on without being continued first: a hung or
    SIGSTOPped server does not need to cooperate. ``tree``: the descendants collected before the
    main process could exit (see the module doc); those that left the group (``setsid``) are reached
    only through it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    for proc in tree:
        if same(proc):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc[0], signal.SIGKILL)


SHM = Path("/dev/shm")


def shm_files(pids: list[int]) -> set[Path]:
    """The ``/dev/shm`` files that any of ``pids`` holds open or mapped (from ``/proc/<pid>/fd`` and
    ``/proc/<pid>/maps``): a server's own shared memory, e.g. SGLang's ``sglang_loads_*.shm`` load
    slots and multiprocessing's ``sem.mp-*`` semaphores, which a SIGKILLed tree never unlinks.
    Unlinked ones (`` (deleted)``) are left out; an unreadable process contributes nothing."""
    found: set[Path] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in (_PROC / str(pid) / "fd").iterdir():
                with contextlib.suppress(OSError):
                    found.add(Path(os.readlink(fd)))
        with contextlib.suppress(OSError):
            for line in (_PROC / str(pid) / "maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    found.add(Path(parts[5]))
    return {p for p in found if p.parent == SHM and not str(p).endswith(" (deleted)")}


def remove_files(paths: set[Path]) -> list[Path]:
    """Unlink ``paths`` (those :func:`shm_files` found in a tree that is gone now); returns the removed."""
    removed = []
    for p in sorted(paths):
        with contextlib.suppress(OSError):
            p.unlink()
            removed.append(p)
    return removed
