"""A server's API key, kept out of every command line and every file but one short-lived 0600 file.

SGLang 0.5.23 takes its key only as ``--api-key`` (no environment variable), which would put it on
the command line of the server, readable by every user in ``ps`` / ``/proc/<pid>/cmdline``. Its
``--config FILE.yaml`` option (``ConfigArgumentMerger``) reads further flags from a YAML file, once,
in the launching process, before anything else starts; the scheduler and detokenizer receive the
parsed arguments, not a command line. So:

* :class:`KeyFile` writes ``api-key: <key>`` into a 0600 file in a fresh 0700 directory outside the
  run directory (``/dev/shm`` when there is one: never written to disk) and removes both once the
  server answers (it has read them by then) or when it stops;
* SGLang prints its arguments (``server_args={... 'api_key': ...}``) and, on a bad flag, the flags it
  could not parse: a :class:`LogPump` sits between the server's stdout/stderr and its log file and
  writes every byte through a :class:`Redactor`, which replaces the key with ``<redacted>``;
* logs are created 0600 (:func:`open_private_log`), whatever the process's umask.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

REDACTED = b"<redacted>"


def _private_tmp_root() -> str | None:
    """Where key files go: ``/dev/shm`` (memory) when this process may write there, else the default."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else None


def new_api_key() -> str:
    """A random server key. It never begins with ``-``: SGLang turns its ``--config`` file into
    ``--api-key <value>`` arguments, and a value that begins with ``-`` is read as an option (the
    server then exits with "argument --api-key: expected one argument")."""
    return "k" + secrets.token_urlsafe(32)


class KeyFile:
    """The server's ``--config`` file holding its key: 0600, in a 0700 directory of its own.

    ``path`` is None until :meth:`write`; :meth:`remove` is idempotent.
    """

    def __init__(self, key: str):
        if not key or key != key.strip() or any(ord(c) < 32 for c in key):
            raise ValueError("an API key must be non-empty, without surrounding spaces or control characters")
        self.key = key
        self.path: Path | None = None

    def write(self) -> Path:
        """Write the file (a new one each call) and return its path."""
        self.remove()
        directory = Path(tempfile.mkdtemp(prefix="acrl-server-key-", dir=_private_tmp_root()))  # 0700
        path = directory / "server-key.yaml"  # SGLang wants a .yaml suffix
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            # A JSON string is a double-quoted YAML scalar: the key is read back as this exact string
            # (unquoted, "true" or "1e3" would come back as a bool or a float).
            f.write(f"api-key: {json.dumps(self.key)}\n")
        self.path = path
        return path

    def remove(self) -> None:
        """Delete the file and its directory (nothing happens if there is none)."""
        if self.path is not None:
            shutil.rmtree(self.path.parent, ignore_errors=True)
            self.path = None


class Redactor:
    """Streaming replacement of secrets in bytes: :meth:`feed` returns what can be written now,
    holding back a tail that could be the start of a secret split across two reads; :meth:`flush`
    returns the rest. A secret never reaches the output, whatever the read boundaries."""

    def __init__(self, secrets: Iterable[str]):
        self.secrets = sorted({s.encode() for s in secrets if s}, key=len, reverse=True)
        self._pending = b""

    def scrub(self, data: bytes) -> bytes:
        """``data`` with every whole secret replaced."""
        for s in self.secrets:
            data = data.replace(s, REDACTED)
        return data

    def feed(self, chunk: bytes) -> bytes:
        data = self.scrub(self._pending + chunk)
        hold = 0
        for s in self.secrets:  # the longest tail of data that is a prefix of a secret
            for n in range(min(len(s) - 1, len(data)), hold, -1):
                if data.endswith(s[:n]):
                    hold = n
                    break
        self._pending = data[len(data) - hold :] if hold else b""
        return data[: len(data) - hold]

    def flush(self) -> bytes:
        out, self._pending = self._pending, b""
        return out


def open_private_log(path: Path) -> BinaryIO:
    """Open ``path`` for appending, created 0600 in a directory created 0700 (an existing file is
    made 0600 too), unbuffered."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab", buffering=0)


class LogPump:
    """Copies a child's output pipe into its log through a :class:`Redactor`, on a daemon thread,
    until every writer has closed the pipe (the server and all its sub-processes are gone)."""

    CHUNK = 65536

    def __init__(self, read_fd: int, out: BinaryIO, secrets: Iterable[str]):
        self.read_fd = read_fd
        self.out = out
        self.redactor = Redactor(secrets)
        self._thread = threading.Thread(target=self._run, name="sglang-log-pump", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while chunk := os.read(self.read_fd, self.CHUNK):
                self._write(self.redactor.feed(chunk))
        except OSError:
            pass  # the pipe was closed under us (stop() after a timeout)
        finally:
            self._write(self.redactor.flush())
            with contextlib.suppress(OSError):
                os.close(self.read_fd)

    def _write(self, data: bytes) -> None:
        if data:
            with contextlib.suppress(OSError, ValueError):  # the log was closed: nothing to keep
                self.out.write(data)

    def join(self, timeout_s: float) -> bool:
        """Wait for the pipe to drain; True when it did within ``timeout_s``."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


__all__ = ["KeyFile", "LogPump", "REDACTED", "Redactor", "open_private_log"]
