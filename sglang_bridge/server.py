"""Start, health-check and stop SGLang servers as child processes (CPU or GPU, one or many).

    spec = ServerSpec(model_path=str(ckpt), device="cpu")
    with SGLangServer(spec, log_path="logs/sglang-0.log") as srv:   # waits until healthy
        print(srv.url)                                                # http://127.0.0.1:<port>
    # stopped: the whole process group is killed

    with ServerGroup([spec, spec], log_dir="logs") as group:         # each on its own free port
        urls = group.urls

Clean-up is unconditional: context-manager exit, ``atexit`` (:func:`stop_all_servers`, over the
process's registry of live servers), and on Linux the child gets ``PR_SET_PDEATHSIG`` so even a
killed parent takes its server with it. Each server runs in its own session (process group), so
SGLang's scheduler/detokenizer sub-processes die with it (they carry SGLang's own PDEATHSIG).

The bridge installs no signal handlers: SIGTERM / SIGINT belong to the process's entry point, whose
handler calls :func:`stop_all_servers`. Without one, SIGINT unwinds through the context managers
(KeyboardInterrupt) and ``atexit``, and SIGTERM ends the process at once, its servers with it
through PDEATHSIG.

Servers bind 127.0.0.1 unless told otherwise: anyone who can reach a server without ``api_key`` can
replace its weights through the update endpoints. How to launch one is :class:`ServerSpec`
(:mod:`sglang_bridge.server_spec`, re-exported here). A keyed server gets its key from a 0600 file
that is removed once it answers, never from its command line, and its output reaches its 0600 log
through a filter that redacts the key (:mod:`sglang_bridge.server_key`). It counts as up only when
it answers with its key, for its model: a server on the same port started by someone else does not.
A fixed port that another process already holds is refused (:class:`PortInUse`), naming that process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Self

from sglang_bridge import proctree
from sglang_bridge.cpu_compat import HOOKS_ENV
from sglang_bridge.listeners import WILDCARDS, port_holder, port_is_free
from sglang_bridge.server_key import KeyFile, LogPump, open_private_log
from sglang_bridge.server_spec import ServerSpec
from sglang_bridge.transport import auth_headers


class ServerStartError(RuntimeError):
    """A server died during start-up or did not become healthy in time (message has its log tail)."""


class PortInUse(ServerStartError):
    """The fixed port of a server is held by another process (``holder`` says which)."""

    def __init__(self, message: str, port: int, holder: str):
        super().__init__(message)
        self.port, self.holder = port, holder


log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; a small race remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# Health: wait until servers answer, or fail naming the one that did not (the driver and the job
# script's `python -m launch.wait_servers` both use this).
# ---------------------------------------------------------------------------------------------


class ServersNotReady(RuntimeError):
    """One or more servers did not come up; ``failed`` maps URL -> last error."""

    def __init__(self, message: str, failed: dict[str, str]):
        super().__init__(message)
        self.failed = failed


def probe(url: str, api_key: str | None = None, timeout_s: float = 2.0) -> tuple[bool, str, bool]:
    """One health request: (ok, what happened, fatal) -- fatal means retrying cannot help."""
    req = urllib.request.Request(url.rstrip("/") + "/model_info", headers=auth_headers(api_key))
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status == 200, f"HTTP {r.status}", False
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            hint = "no API key sent" if not api_key else "API key rejected"
            return False, f"HTTP {err.code} ({hint}: the server runs with a different --api-key)", True
        return False, f"HTTP {err.code}", False
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return False, f"not reachable ({reason})", False


def answers_anonymous(url: str, timeout_s: float = 2.0) -> bool:
    """True when the server at ``url`` answers ``/model_info`` without any key: it has none, and
    anyone who can reach it can steer it."""
    return probe(url, None, timeout_s)[0]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (exited, not yet reaped by the job shell) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def wait_for_servers(
    urls: Sequence[str],
    timeout_s: float,
    api_key: str | None = None,
    poll_s: float = 1.0,
    watch_pid: int | None = None,
    log_hint: str | None = None,
    refused_for_s: float | None = None,
) -> None:
    """Block until every URL is healthy; raise :class:`ServersNotReady` naming each one that is not.

    ``log_hint`` is a format string with ``{index}`` and ``{url}`` pointing at a server's log, added
    to the message so the reader knows where to look. ``refused_for_s``: give up on a URL whose
    connection is refused at every probe for this long -- nothing listens there. Only for servers
    that should already run (the trainer's ``rollout.server_urls``, after the job script's wait): a
    server that is still loading refuses connections too, so a wait for a starting one passes None.
    """
    pending = dict.fromkeys(urls, "not probed yet")
    refused_since: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        fatal: dict[str, str] = {}
        for url in list(pending):
            ok, what, is_fatal = probe(url, api_key)
            if ok:
                del pending[url]
            else:
                pending[url] = what
                if is_fatal:
                    fatal[url] = what
            if ok or "Connection refused" not in what:
                refused_since.pop(url, None)
            elif (
                refused_for_s is not None
                and time.monotonic() - refused_since.setdefault(url, time.monotonic()) >= refused_for_s
            ):
                fatal[url] = f"{what} for {refused_for_s:g} s: no server listens there"
        if not pending:
            return
        if fatal:
            raise ServersNotReady(_message(urls, fatal, "refused the trainer", log_hint), fatal)
        if watch_pid is not None and not _pid_alive(watch_pid):
            raise ServersNotReady(
                _message(
                    urls, pending, f"exited before becoming healthy (process {watch_pid} is gone)", log_hint
                ),
                pending,
            )
        if time.monotonic() >= deadline:
            raise ServersNotReady(
                _message(urls, pending, f"did not come up within {timeout_s:.0f} s", log_hint), pending
            )
        time.sleep(poll_s)


def _message(urls: Sequence[str], failed: dict[str, str], what: str, log_hint: str | None) -> str:
    lines = [f"{len(failed)} of {len(urls)} rollout server(s) {what}:"]
    for url, err in failed.items():
        idx = list(urls).index(url)
        line = f"  server {idx} at {url}: {err}"
        if log_hint:
            line += f"; see its log {log_hint.format(index=idx, url=url)}"
        lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Process-wide registry of live servers, for atexit clean-up and the entry point's signal handler.
# ---------------------------------------------------------------------------------------------

_LIVE: set[Any] = set()  # SGLangServer, SGLangRouter: anything with stop()
_LIVE_LOCK = threading.Lock()


def stop_all_servers() -> None:
    """Stop every live server this process started (the entry point's signal handler and atexit call it)."""
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for s in servers:
        with contextlib.suppress(Exception):
            s.stop()


def register_child(child: Any) -> None:
    """Put another child process owner (anything with ``stop()``, e.g. the router) in the registry
    :func:`stop_all_servers` and ``atexit`` stop."""
    _stop_all_at_exit()
    with _LIVE_LOCK:
        _LIVE.add(child)


def unregister_child(child: Any) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(child)


@functools.cache
def _stop_all_at_exit() -> None:
    """Register :func:`stop_all_servers` with ``atexit``, once per process (at the first launch)."""
    atexit.register(stop_all_servers)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def _preexec(die_with_parent: bool, cpus: tuple[int, ...] | None) -> Callable[[], None] | None:
    """What the child runs between fork and exec: PDEATHSIG and / or its CPU affinity."""
    if not die_with_parent and cpus is None:
        return None

    def run() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)  # before exec: inherited by every thread and child
        if die_with_parent:
            _die_with_parent()

    return run


class ChildProcess:
    """What the bridge's child processes (a server, the router) share: the tail of their log for
    error messages, and a context that starts the child and always stops it."""

    log_path: Path

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def log_tail(self, n_lines: int = 40) -> str:
        """Last ``n_lines`` of the child's log (read from its last 16 KiB)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-n_lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SGLangServer(ChildProcess):
    """One SGLang server child process; a context manager that starts it and always stops it."""

    def __init__(
        self,
        spec: ServerSpec,
        log_path: str | Path,
        startup_timeout_s: float = 300.0,
        name: str | None = None,
    ):
        self.spec = spec
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.port: int = spec.port or 0
        self.name = name or f"sglang@{spec.host}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._log_start = 0
        self._key_file = KeyFile(spec.api_key) if spec.api_key else None
        self._pump: LogPump | None = None

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:30000``."""
        host = "127.0.0.1" if self.spec.host in ("0.0.0.0", "") else self.spec.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        """True while the server's main process runs."""
        return self._proc is not None and self._proc.poll() is None

    def launch(self) -> SGLangServer:
        """Spawn the process (returns at once; see :meth:`wait_healthy`)."""
        if self._proc is not None:
            raise RuntimeError(f"{self.name}: already launched (pid {self._proc.pid})")
        self.spec.check_cpus()
        model = Path(self.spec.model_path)
        if (model.is_absolute() or self.spec.model_path.startswith(".")) and not (
            model / "config.json"
        ).is_file():
            # SGLang would treat it as a hub id, fail, and (in 0.5.23) keep its process alive.
            raise ServerStartError(f"{self.name}: model path {model} has no config.json")
        _stop_all_at_exit()
        bind_host = "127.0.0.1" if self.spec.host in WILDCARDS else self.spec.host
        self.port = self.spec.port or free_port(bind_host)
        self.name = f"{self.name.split(':')[0]}:{self.port}"
        if self.spec.port is not None and not port_is_free(self.spec.host, self.port):
            holder = port_holder(self.port)
            raise PortInUse(
                f"{self.name}: port {self.port} is held by {holder}, which this process did not start: "
                "it is neither used nor stopped. Pick another port, or none to get a free one",
                self.port,
                holder,
            )
        key_path = self._key_file.write() if self._key_file else None
        cmd = self.spec.command(self.port, key_path)
        self._log_file = open_private_log(self.log_path)
        self._log_file.write(f"# {' '.join(cmd)}\n".encode())
        env = self.spec.env()
        if env.get(HOOKS_ENV):  # the log says which CPU emulations (e.g. the FP8 KV cache) this server runs
            self._log_file.write(f"# {HOOKS_ENV}={env[HOOKS_ENV]}\n".encode())
        self._log_start = self.log_path.stat().st_size  # this launch's part of the log starts here
        # PDEATHSIG fires when the *thread* that forked exits, so only use it from the main thread.
        preexec = _preexec(
            sys.platform == "linux" and threading.current_thread() is threading.main_thread(),
            self.spec.cpus,
        )
        read_fd, write_fd = os.pipe()  # the child's output reaches its log through the key filter
        try:
            self._proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=write_fd,
                stderr=write_fd,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=preexec,
            )
        except subprocess.SubprocessError as e:  # the child's preexec failed: nothing was started
            os.close(read_fd)
            self._close_files()
            raise ServerStartError(
                f"{self.name}: could not bind the server to cores {list(self.spec.cpus or ())} "
                f"(ServerSpec.cpus / rollout.server_cpus): {e} The host or this job's cpuset does not "
                "allow them; pick cores this job may use (see /sys/fs/cgroup/cpuset.cpus.effective)"
            ) from e
        finally:
            os.close(write_fd)
        self._pump = LogPump(read_fd, self._log_file, [self.spec.api_key or ""])
        with _LIVE_LOCK:
            _LIVE.add(self)
        return self

    PORT_RETRIES = 3
    """Relaunches on a fresh port when a picked port was taken before SGLang bound it."""

    def _lost_port_race(self) -> bool:
        """True when this launch's log shows SGLang could not bind its HTTP port.

        A port picked by :func:`free_port` is only free when picked; another process (often a server
        starting next to this one, taking ports for its own IPC) can bind it first. SGLang then
        logs ``[Errno 98] ... address already in use`` and lingers ~10 s before exiting.
        """
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return b"address already in use" in f.read()
        except OSError:
            return False

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Block until ``/model_info`` answers; raise :class:`ServerStartError` (with log tail) otherwise.

        A server whose automatically picked port was taken before it could bind is relaunched on a
        new port (at most :attr:`PORT_RETRIES` times); a port the spec fixes is never changed.
        """
        deadline = time.monotonic() + (self.startup_timeout_s if timeout_s is None else timeout_s)
        retries = self.PORT_RETRIES
        while True:
            if self.spec.port is None and retries > 0 and self._lost_port_race():
                retries -= 1
                log.warning("%s: port taken before SGLang bound it; relaunching on another port", self.name)
                self.stop()
                self._proc = None
                self.launch()
                continue
            if not self.alive():
                rc = self._proc.returncode if self._proc else None
                self.stop()  # drains its output into the log first
                tail = self.log_tail()
                raise ServerStartError(
                    f"{self.name} exited during start-up (rc={rc}); log {self.log_path}:\n{tail}"
                )
            if self._model_info_ok():
                if self._key_file is not None:  # read at start-up; no copy of the key is left on disk
                    self._key_file.remove()
                return
            if time.monotonic() > deadline:
                self.stop()
                tail = self.log_tail()
                raise ServerStartError(
                    f"{self.name} not healthy after {self.startup_timeout_s:.0f}s; "
                    f"log {self.log_path}:\n{tail}"
                )
            time.sleep(1.0)

    def _model_info_ok(self) -> bool:
        """Ours and up: our process runs, and the port answers our key (a server started by anyone
        else, even for the same model, refuses it) with our model."""
        if not self.alive():
            return False
        req = urllib.request.Request(self.url + "/model_info", headers=auth_headers(self.spec.api_key))
        try:
            with urllib.request.urlopen(req, timeout=2.0) as r:
                info = json.loads(r.read() or b"{}")
                return r.status == 200 and info.get("model_path") == self.spec.model_path
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def start(self) -> SGLangServer:
        """Launch and wait until healthy."""
        self.launch()
        self.wait_healthy()
        return self

    def frozen(self) -> list[int]:
        """The pids of this server's process tree that are stopped (SIGSTOP: they run no code
        until continued, so they answer nothing and act on no signal but SIGKILL)."""
        if not self.alive():
            return []
        assert self._proc is not None
        return proctree.stopped([self._proc.pid, *(p for p, _ in proctree.descendants(self._proc.pid))])

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the whole process tree: SIGTERM, then SIGKILL after ``grace_s`` (at once when a
        process of it is stopped: it cannot act on SIGTERM). Idempotent; the registry forgets it."""
        proc = self._proc
        if proc is not None:
            # Collected first: a child whose parent is gone can no longer be found (proctree doc).
            tree = proctree.descendants(proc.pid) if proc.poll() is None else []
            # Its shared memory too: a killed tree never unlinks it, and /dev/shm fills up.
            shm = proctree.shm_files([proc.pid, *(p for p, _ in tree)])
            if proc.poll() is None and not self.frozen():
                self._signal_group(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    pass
            # Children (scheduler, detokenizer) may outlive the main process: kill the tree regardless.
            proctree.kill_tree(proc.pid, tree)
            with contextlib.suppress(subprocess.TimeoutExpired):  # reaped: alive() is False after stop()
                proc.wait(timeout=max(grace_s, 10.0))
            proctree.remove_files(shm)
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self._pump is not None:
            self._pump.join(timeout_s=5.0)  # the group is gone: its last lines reach the log
            self._pump = None
        self._close_files()

    def _close_files(self) -> None:
        if self._key_file is not None:
            self._key_file.remove()
        if self._log_file is not None:
            with contextlib.suppress(Exception):
                self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """SIGKILL the process group at once (fault injection)."""
        self._signal_group(signal.SIGKILL)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)

    def _signal_group(self, sig: int) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)  # start_new_session: pgid == pid

    def __repr__(self) -> str:
        return f"SGLangServer({self.name}, pid={self.pid}, model={self.spec.model_path})"


class ServerGroup:
    """Several servers, each on its own port; started concurrently, healthy together, stopped together."""

    def __init__(self, specs: Sequence[ServerSpec], log_dir: str | Path, startup_timeout_s: float = 300.0):
        used: set[int] = set()
        self.servers: list[SGLangServer] = []
        for i, spec in enumerate(specs):
            port = spec.port
            while port is None or port in used:
                port = free_port(spec.host if spec.host != "0.0.0.0" else "127.0.0.1")
            used.add(port)
            self.servers.append(
                SGLangServer(
                    replace(spec, port=port),
                    Path(log_dir) / f"sglang-{i}.log",
                    startup_timeout_s,
                    name=f"sglang[{i}]",
                )
            )

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def start(self) -> ServerGroup:
        try:
            for s in self.servers:
                s.launch()
            for s in self.servers:
                s.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> ServerGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __iter__(self) -> Iterator[SGLangServer]:
        return iter(self.servers)


__all__ = [
    "PortInUse",
    "ServerGroup",
    "ServerSpec",
    "ServerStartError",
    "ServersNotReady",
    "SGLangServer",
    "answers_anonymous",
    "free_port",
    "probe",
    "register_child",
    "stop_all_servers",
    "unregister_child",
    "wait_for_servers",
]
