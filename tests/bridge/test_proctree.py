"""A hung server's whole process tree is killed (issue #25): read from /proc before the kill, so a
child that left the process group goes too; SIGKILL needs no cooperation from a stopped process.
Plain Python processes stand in for SGLang's (no server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from sglang_bridge import proctree

# A leader in its own session with two children: one in its group, one that left it (setsid); each
# prints its pid and sleeps.
TREE = """
import os, subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=s)
        for s in (False, True)]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(600)
"""


def _tree() -> tuple[subprocess.Popen, list[int]]:
    leader = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, start_new_session=True)
    assert leader.stdout is not None
    kids = [int(p) for p in leader.stdout.readline().split()]
    return leader, kids


def _gone(pids: list[int], within_s: float = 10.0) -> bool:
    """Whether every one of ``pids`` has exited (polled: an exit is not instant)."""
    deadline = time.monotonic() + within_s
    while any(proctree.alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_stopped_tree_is_found_and_killed_whole_also_a_child_outside_its_group() -> None:
    leader, kids = _tree()
    try:
        tree = proctree.descendants(leader.pid)
        assert sorted(p for p, _ in tree) == sorted(kids)
        for p in [leader.pid, *kids]:
            os.kill(p, signal.SIGSTOP)  # hung: no code runs, no signal but SIGKILL acts
        deadline = time.monotonic() + 10
        while len(proctree.stopped([leader.pid, *kids])) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(proctree.stopped([leader.pid, *kids])) == sorted([leader.pid, *kids])
        proctree.kill_tree(leader.pid, tree)
        leader.wait(timeout=10)
        assert _gone(kids)  # the one outside the group too: killpg alone would have left it
    finally:
        for p in [leader.pid, *kids]:
            if proctree.alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_pid_reused_by_another_process_is_not_killed() -> None:
    """A process of the tree collected earlier is killed only while it is still that process."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        stale = (other.pid, -1)  # the pid, with another process's start time
        assert not proctree.same(stale)
        proctree.kill_tree(other.pid + 10**7, [stale])  # no such group; the pid is not that process
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
