"""Run untrusted Python under a real sandbox: bubblewrap (Linux namespaces) plus resource limits.

What a run gets (:class:`Sandbox`):

* its own user, PID, network, IPC, UTS and cgroup namespaces (``bwrap --unshare-all``): no network at
  all (not even the host's loopback), no view of the host's processes;
* a read-only system (``/usr`` and the ``/bin``, ``/lib*`` links or directories, the interpreter's own
  prefix when it lives elsewhere), a fresh ``/dev`` and ``/proc``, and one writable place: a private
  temporary directory mounted at ``/tmp`` (also its working directory and ``HOME``), removed after;
* ``setrlimit`` limits set in the child before bwrap starts, inherited by everything in the sandbox:
  CPU seconds, address space, file size, number of processes, no core dumps;
* limits the parent enforces: wall time and the size of stdout + stderr;
* the end of the run kills the whole tree: the sandbox's PID-namespace init (the program) is
  SIGKILLed (the kernel then kills every process in the namespace, a double-forked daemon too) and
  the parent waits until it is gone.

Run as root, each run drops to a fresh unprivileged uid before bwrap starts: the kernel does not
enforce ``RLIMIT_NPROC`` on root, a fork bomb must meet it, and the limit counts per uid (a uid of
its own keeps parallel runs from sharing it). The program is the namespace's PID 1 (``--as-pid-1``):
when it exits the kernel kills everything it left, and bwrap, its parent, reaps it.

A machine that cannot sandbox (no ``bwrap``, user namespaces refused) gets :class:`SandboxUnavailable`
naming what is missing and how to get it; there is no unsandboxed fallback.

No torch or transformers here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatron_acrl.rollout.agent.tools import cap_text

SandboxOutcome = Literal["ok", "error", "cpu_time", "memory", "wall_time", "output_too_large", "killed"]
"""How a run ended: ok (exit 0), error (a nonzero exit: an exception, a refused write, a refused
connection), cpu_time (RLIMIT_CPU), memory (an allocation refused by RLIMIT_AS), wall_time (killed
by the parent's clock), output_too_large (killed once stdout + stderr passed the cap), killed (any
other signal)."""


class SandboxUnavailable(RuntimeError):
    """This machine cannot run the sandbox; the message names what is missing and how to get it."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run (all > 0)."""

    cpu_time_s: int = 10
    """CPU seconds (RLIMIT_CPU; the process gets SIGXCPU, then SIGKILL a second later)."""

    memory_mb: int = 1024
    """Address space in MiB (RLIMIT_AS): an allocation past it fails (MemoryError in Python)."""

    file_size_mb: int = 16
    """Largest file a run may write, in MiB (RLIMIT_FSIZE)."""

    max_processes: int = 32
    """Processes (and threads) the sandbox user may have (RLIMIT_NPROC): a fork bomb meets it."""

    wall_time_s: float = 20.0
    """Wall-clock seconds before the parent kills the run (a sleep uses no CPU time)."""

    max_output_bytes: int = 65536
    """stdout + stderr bytes the parent reads before it kills the run."""

    def __post_init__(self) -> None:
        for name in (
            "cpu_time_s",
            "memory_mb",
            "file_size_mb",
            "max_processes",
            "wall_time_s",
            "max_output_bytes",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SandboxResult:
    """One run: its output (valid UTF-8, each stream at most ``max_output_bytes``), its exit code
    (None when the parent killed it) and how it ended."""

    stdout: str
    stderr: str
    exit_code: int | None
    outcome: SandboxOutcome


_UID_BASE, _UID_SPAN = 1_900_000_000, 100_000_000


def _sandbox_user() -> int | None:
    """The uid one run drops to when running as root: a fresh one per run, from a range no account
    uses, so that RLIMIT_NPROC (counted per uid, zombies included) counts this run's processes only,
    not those of runs in parallel. None when not root: the run stays this user."""
    if os.geteuid() != 0:
        return None
    return _UID_BASE + secrets.randbelow(_UID_SPAN)


def default_python() -> str:
    """The interpreter the sandbox runs: the system's ``/usr/bin/python3`` when there is one (readable
    by an unprivileged user, no project packages), else this process's base interpreter."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(cand, os.X_OK):
            return cand
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _system_mounts(python: str) -> list[str]:
    """bwrap arguments for a read-only system: /usr, the top-level links into it (or the directories),
    and the interpreter's prefix when it is elsewhere."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    real = os.path.realpath(python)
    if not real.startswith("/usr/"):
        prefix = str(Path(real).parent.parent)  # <prefix>/bin/python3
        args += ["--ro-bind", prefix, prefix]
    return args


def _bwrap_argv(bwrap: str, python: str, workdir: str, info_fd: int | None) -> list[str]:
    argv = [bwrap, *_system_mounts(python), "--dev", "/dev", "--proc", "/proc"]
    argv += ["--bind", workdir, "/tmp", "--chdir", "/tmp"]
    # bwrap's root is a tmpfs: make it read-only too (after the mount points above exist on it).
    argv += ["--remount-ro", "/", "--remount-ro", "/dev"]  # device nodes stay writable on a ro mount
    argv += ["--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    argv += ["--clearenv", "--setenv", "HOME", "/tmp", "--setenv", "PATH", "/usr/bin:/bin"]
    argv += ["--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "LANG", "C.UTF-8"]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    return argv


def _user_tasks(uid: int) -> int:
    """Processes and threads of ``uid`` now (what RLIMIT_NPROC counts)."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
    return n


def _limits_in_child(limits: SandboxLimits, uid: int | None, nproc: int) -> Any:
    """The ``preexec_fn`` of the bwrap process: limits, then (as root) the unprivileged user."""
    mem = limits.memory_mb * 1024 * 1024
    fsize = limits.file_size_mb * 1024 * 1024

    def lower(which: int, soft: int, hard: int) -> None:
        # Only lower: a limit above the current hard one cannot be set (nor is it needed).
        cur = resource.getrlimit(which)[1]
        if cur != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur), min(hard, cur)
        resource.setrlimit(which, (soft, hard))

    def apply() -> None:
        lower(resource.RLIMIT_CPU, limits.cpu_time_s, limits.cpu_time_s + 1)
        lower(resource.RLIMIT_AS, mem, mem)
        lower(resource.RLIMIT_FSIZE, fsize, fsize)
        lower(resource.RLIMIT_NPROC, nproc, nproc)
        lower(resource.RLIMIT_CORE, 0, 0)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return apply


@functools.lru_cache(maxsize=4)
def check_sandbox(python: str | None = None) -> str:
    """The path of ``bwrap`` once a probe run has shown the sandbox works here; else
    :class:`SandboxUnavailable` naming what is missing and how to get it. Cached per interpreter."""
    python = python or default_python()
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "the Python tool's sandbox needs bubblewrap (bwrap), which is not installed: install the "
            "package `bubblewrap` (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install "
            "bubblewrap); untrusted code is never run without it"
        )
    uid = _sandbox_user()
    with tempfile.TemporaryDirectory(prefix="acrl-sandbox-probe-") as work:
        if uid is not None:
            os.chown(work, uid, uid)
        argv = _bwrap_argv(bwrap, python, work, None) + ["--", python, "-I", "-c", "print('ok')"]
        probe = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=_limits_in_child(SandboxLimits(), uid, 1 << 20),
            check=False,
        )
    if probe.returncode != 0 or probe.stdout.strip() != "ok":
        raise SandboxUnavailable(
            f"bubblewrap cannot create the sandbox here (exit {probe.returncode}: "
            f"{probe.stderr.strip()[:300]!r}). It needs unprivileged user namespaces: check "
            "`sysctl user.max_user_namespaces` (> 0) and `kernel.unprivileged_userns_clone` (1), and in a "
            "container allow them (docker: --security-opt seccomp=unconfined --security-opt "
            f"apparmor=unconfined); the interpreter {python} must be readable by the sandbox user"
        )
    return bwrap


class Sandbox:
    """Runs Python code in a fresh bubblewrap sandbox per call (see the module's docstring)."""

    def __init__(self, limits: SandboxLimits | None = None, python: str | None = None):
        self.limits = limits or SandboxLimits()
        self.python = python or default_python()
        self.bwrap = check_sandbox(self.python)

    async def run_python(self, code: str, stdin: str = "") -> SandboxResult:
        """Run ``code`` (a Python program, its file at ``/tmp/main.py``) with ``stdin``; never raises
        for anything the code does. Returns once every process of the run is gone."""
        work = tempfile.mkdtemp(prefix="acrl-sandbox-")
        info = dict(zip(("r", "w"), os.pipe(), strict=True))  # bwrap's --info-fd pipe
        uid = _sandbox_user()
        try:
            Path(work, "main.py").write_text(code, encoding="utf-8")
            if uid is not None:
                for p in (work, os.path.join(work, "main.py")):
                    os.chown(p, uid, uid)
            return await self._run(work, stdin, uid, info)
        finally:
            # Each fd closed exactly once: a second close could hit a number reused meanwhile.
            for fd in info.values():
                os.close(fd)
            shutil.rmtree(work, ignore_errors=True)

    async def _run(self, work: str, stdin: str, uid: int | None, info: dict[str, int]) -> SandboxResult:
        lim = self.limits
        # Outside root, RLIMIT_NPROC counts the user's every task (the trainer's threads too).
        nproc = lim.max_processes if uid is not None else _user_tasks(os.getuid()) + lim.max_processes
        argv = _bwrap_argv(self.bwrap, self.python, work, info["w"])
        argv += ["--", self.python, "-I", "/tmp/main.py"]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=_limits_in_child(lim, uid, nproc),
            start_new_session=True,
            pass_fds=(info["w"],),
        )
        os.close(info.pop("w"))  # bwrap holds it now: EOF once bwrap is gone
        init_fd = await _namespace_init(info["r"], proc.pid)
        try:
            return await self._collect(proc, stdin, init_fd)
        finally:
            await _reap_namespace(init_fd)

    async def _collect(
        self, proc: asyncio.subprocess.Process, stdin: str, init_fd: int | None
    ) -> SandboxResult:
        """Feed stdin, read the output under the cap and wait under the wall-time limit."""
        lim = self.limits
        budget = [lim.max_output_bytes]
        bufs: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}
        over = asyncio.Event()

        async def pump(stream: asyncio.StreamReader, buf: bytearray) -> None:
            # Read to EOF even past the cap (discarding): asyncio's wait() returns only once every
            # pipe is closed, and a pipe nobody reads is never seen closed.
            while chunk := await stream.read(65536):
                buf += chunk[: max(budget[0], 0)]
                budget[0] -= len(chunk)
                if budget[0] < 0:
                    over.set()

        async def feed() -> None:
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(stdin.encode())
                await proc.stdin.drain()
                proc.stdin.close()

        assert proc.stdout is not None and proc.stderr is not None
        work_task = asyncio.gather(
            feed(), pump(proc.stdout, bufs["out"]), pump(proc.stderr, bufs["err"]), proc.wait()
        )
        over_task = asyncio.ensure_future(over.wait())
        outcome: SandboxOutcome | None = None
        try:
            done, _ = await asyncio.wait(
                {work_task, over_task}, timeout=lim.wall_time_s, return_when="FIRST_COMPLETED"
            )
            if over_task in done:
                outcome = "output_too_large"
            elif work_task not in done:
                outcome = "wall_time"
        finally:
            over_task.cancel()
            if outcome is not None or not work_task.done():
                # The namespace's init first (its processes hold the output pipes, which wait()
                # needs closed): bwrap, still alive, reaps it and exits. Killing bwrap first would
                # orphan the init's zombie to PID 1, where it counts against RLIMIT_NPROC until reaped.
                _kill_init(init_fd)
                try:
                    await asyncio.wait_for(proc.wait(), timeout=5.0)
                except TimeoutError:
                    _kill_group(proc.pid)
            await proc.wait()
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work_task
        rc = proc.returncode
        out = cap_text(bytes(bufs["out"]), lim.max_output_bytes)[0]
        err = cap_text(bytes(bufs["err"]), lim.max_output_bytes)[0]
        if outcome is None:
            outcome = _classify(rc, err)
        return SandboxResult(out, err, None if outcome in ("wall_time", "output_too_large") else rc, outcome)


def _classify(rc: int | None, stderr: str) -> SandboxOutcome:
    """How a run that ended by itself ended, from bwrap's exit code (a signal ``s`` of the program
    reads as 128 + s, or -s where bwrap itself got it) and the program's stderr."""
    if rc == 0:
        return "ok"
    sig = -rc if rc is not None and rc < 0 else (rc - 128 if rc is not None and rc > 128 else None)
    if sig in (signal.SIGXCPU, signal.SIGKILL):
        # RLIMIT_CPU's soft limit sends SIGXCPU, its hard limit (a second later) SIGKILL; nothing
        # else in the sandbox sends SIGKILL to the program.
        return "cpu_time"
    if "MemoryError" in stderr or sig == signal.SIGSEGV:
        return "memory"
    return "killed" if sig is not None else "error"


def _kill_init(init_fd: int | None) -> None:
    if init_fd is not None:
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(init_fd, signal.SIGKILL)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _namespace_init(info_r: int, bwrap_pid: int) -> int | None:
    """A pidfd of the sandbox's PID-namespace init (bwrap's ``--info-fd`` names its pid), or None when
    bwrap failed before making one. The pid is checked to be bwrap's child after the pidfd is open,
    so a pid reused by another process is never signalled."""
    # bwrap writes one small JSON object, in one write, right after it starts the namespace (EOF
    # if it fails first); wait for it on the loop, never in a thread that could outlive the fd.
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    os.set_blocking(info_r, False)
    loop.add_reader(info_r, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(info_r)
    try:
        raw = os.read(info_r, 4096)
    except BlockingIOError:
        return None
    try:
        pid = int(json.loads(raw.decode() or "{}").get("child-pid", 0))
    except (ValueError, AttributeError):
        return None
    if pid <= 0:
        return None
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None  # already gone (and its namespace with it)
    try:
        with open(f"/proc/{pid}/status") as f:  # noqa: PTH123
            ppid = next((int(line.split()[1]) for line in f if line.startswith("PPid:")), -1)
    except OSError:
        ppid = -1
    if ppid != bwrap_pid:
        os.close(fd)
        return None
    return fd


async def _reap_namespace(init_fd: int | None) -> None:
    """SIGKILL the sandbox's PID-namespace init and wait until it is gone: the kernel kills every
    process of the namespace (a double-forked daemon too) before the init's exit completes, so
    nothing of the run outlives this call."""
    if init_fd is None:
        return
    try:
        _kill_init(init_fd)
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(init_fd, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait_for(exited, timeout=30.0)
        except TimeoutError:  # pragma: no cover - a process SIGKILL cannot stop
            pass
        finally:
            loop.remove_reader(init_fd)
    finally:
        os.close(init_fd)
