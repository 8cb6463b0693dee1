"""Wait until rollout servers answer, or fail with a message that names the one that did not.

The job script's command-line front of :func:`sglang_bridge.server.wait_for_servers` (which the
driver calls itself), run before it starts the trainer::

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

from megatron_acrl.config.exit_codes import SERVERS_UNAVAILABLE
from sglang_bridge.server import ServersNotReady, wait_for_servers


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
