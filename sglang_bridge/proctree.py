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
