"""Wait until rollout servers answer, or fail with a message that names the one that did not.

Used by the job script before it starts the trainer, and importable by the driver::

    from launch.wait_servers import wait_for_servers
    wait_for_servers(cfg.rollout.server_urls, timeout_s=cfg.rollout.startup_timeout_s,
                     api_key=os.environ.get(cfg.rollout.api_key_env or "", None))

    python -m launch.wait_servers --timeout 300 --api-key-env ACRL_SGLANG_API_KEY \\
        --watch-pid $SERVER_SRUN_PID --log-hint 'logs/server-{index}.log' http://n3:30000 http://n3:30001

A server is up when ``GET /model_info`` answers 200 (what :mod:`sglang_bridge.server` checks too).
A 401/403 is not retried: the key is wrong and waiting will not fix it. With ``watch_pid`` (the
``srun`` that runs the servers) the wait stops as soon as that process is gone instead of running
into the timeout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from launch.exit_codes import SERVERS_UNAVAILABLE


class ServersNotReady(RuntimeError):
    """One or more servers did not come up; ``failed`` maps URL -> last error."""

    def __init__(self, message: str, failed: dict[str, str]):
        super().__init__(message)
        self.failed = failed


def probe(url: str, api_key: str | None = None, timeout_s: float = 2.0) -> tuple[bool, str, bool]:
    """One health request: (ok, what happened, fatal) -- fatal means retrying cannot help."""
    req = urllib.request.Request(url.rstrip("/") + "/model_info")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
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
) -> None:
    """Block until every URL is healthy; raise :class:`ServersNotReady` naming each one that is not.

    ``log_hint`` is a format string with ``{index}`` and ``{url}`` pointing at a server's log, added
    to the message so the reader knows where to look.
    """
    pending = dict.fromkeys(urls, "not probed yet")
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.wait_servers", description=__doc__.split("\n")[0])
    ap.add_argument("urls", nargs="+", help="server base URLs, e.g. http://node3:30000")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for all servers")
    ap.add_argument("--api-key-env", default=None, help="environment variable holding the servers' API key")
    ap.add_argument(
        "--watch-pid", type=int, default=None, help="stop waiting when this process (the servers' srun) exits"
    )
    ap.add_argument("--log-hint", default=None, help="format string of a server's log path ({index}, {url})")
    ap.add_argument("--poll", type=float, default=1.0, help="seconds between probes")
    args = ap.parse_args(argv)
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    if args.api_key_env and not api_key:
        print(f"error: --api-key-env {args.api_key_env} is not set in the environment", file=sys.stderr)
        return SERVERS_UNAVAILABLE
    start = time.monotonic()
    try:
        wait_for_servers(args.urls, args.timeout, api_key, args.poll, args.watch_pid, args.log_hint)
    except ServersNotReady as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return SERVERS_UNAVAILABLE
    print(
        f"all {len(args.urls)} rollout server(s) healthy after {time.monotonic() - start:.1f} s", flush=True
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
