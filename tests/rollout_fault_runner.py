"""A driver run whose lone rollout server hangs, or whose sglang-router dies, in the middle of a
rollout (issue #36 item 2).

    python tests/rollout_fault_runner.py SPEC.json

SPEC as :mod:`e2e_runner`'s, with ``"hooks"``:

* ``"sigstop_server_after_publish": k`` -- once the k-th weight publish (after RL step k) has
  returned, server 0's whole process group is stopped with SIGSTOP as soon as a rollout request is
  in flight on it, and stays stopped (a hung server: its process runs, it answers nothing);
* ``"kill_router_after_publish": k`` -- the same moment, the sglang-router's process group is
  killed with SIGKILL;
* ``"sigstop_server_while_waiting": k`` (async mode) -- server 0 is stopped as above once the
  trainer waits for a batch, from step index k on, that is not ready yet (so that the rollout, not
  the next weight sync, is what meets the hung server).

At the end, before the servers stop, ``<run_dir>/fault.json`` records what the test checks: the
processes signalled (still running?), the router's port before and after, and whether the stopped
server is still the run's.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import e2e_runner  # this directory is on sys.path: the runner is run as a script from it

from sglang_bridge import proctree

WAIT_S = 600.0
"""How long the fault thread waits for a request in flight (a deadlock guard)."""


def _strike(ctx, hooks: dict, seen: dict) -> None:
    """Wait until a rollout request is in flight, then signal the target (module doc)."""
    servers = ctx.servers
    deadline = time.monotonic() + WAIT_S
    while not any(servers.in_flight().values()):
        if time.monotonic() > deadline:
            seen["error"] = "no request was ever in flight"
            return
        time.sleep(0.01)
    if "sigstop_server_after_publish" in hooks or "sigstop_server_while_waiting" in hooks:
        victim = servers.servers[0]
        seen["pids"] = [victim.pid, *(p for p, _ in proctree.descendants(victim.pid))]
        seen["server"] = victim
        os.killpg(victim.pid, signal.SIGSTOP)  # the whole server: HTTP front end and scheduler
    else:
        router = servers.router
        seen["router_port"] = router.port
        seen["pids"] = [router._proc.pid]
        os.killpg(router._proc.pid, signal.SIGKILL)
    seen["at"] = time.time()
    print(f"fault injected: {sorted(hooks)} pids {seen['pids']}", file=sys.stderr, flush=True)


def _arm(ctx, hooks: dict, seen: dict) -> None:
    """Count the publishes; after the k-th, start the fault thread."""
    k = hooks.get("sigstop_server_after_publish", hooks.get("kill_router_after_publish"))
    publish, count = ctx.publisher.publish, {"n": 0}

    def counted(version: int):
        out = publish(version)
        count["n"] += 1
        if count["n"] == k:
            threading.Thread(target=_strike, args=(ctx, hooks, seen), daemon=True).start()
        return out

    ctx.publisher.publish = counted


def _arm_waiting(ctx, hooks: dict, seen: dict) -> None:
    """Async mode: strike when the trainer starts waiting for a batch that is not ready."""
    from megatron_acrl.rollout.engine import GenerationEngine

    wait_batch = GenerationEngine.wait_batch
    k = hooks["sigstop_server_while_waiting"]

    def waiting(engine, step: int):
        if step >= k and "armed" not in seen:
            with engine.cond:
                ready = len(engine.queue.ready()) >= ctx.cfg.rollout.prompts_per_step
            if not ready:
                seen["armed"] = step
                threading.Thread(target=_strike, args=(ctx, hooks, seen), daemon=True).start()
        return wait_batch(engine, step)

    GenerationEngine.wait_batch = waiting


def _report(ctx, seen: dict, out: Path) -> None:
    servers = ctx.servers
    report = {
        "signalled_pids": seen.get("pids", []),
        "still_running": [p for p in seen.get("pids", []) if proctree.alive(p)],
        "error": seen.get("error"),
        "router_port_before": seen.get("router_port"),
        "router_port_after": servers.router.port if servers.router is not None else None,
        "router_alive": servers.router is not None and servers.router.alive(),
        "replaced": seen.get("server") is not None and seen["server"] not in servers.servers,
        "routed": sorted(servers._routed),
        "urls": list(servers.urls),
    }
    out.write_text(json.dumps(report, indent=1))


def prepare_for(hooks: dict):
    def prepare(ctx):
        if ctx.servers is None or not hooks:
            return
        seen: dict = {}
        if "sigstop_server_while_waiting" in hooks:
            _arm_waiting(ctx, hooks, seen)
        else:
            _arm(ctx, hooks, seen)
        close = ctx.close

        def reported_close():
            if ctx.servers is not None and sys.exc_info()[0] is None:  # not after a failed run
                _report(ctx, seen, ctx.run_dir / "fault.json")
            close()

        ctx.close = reported_close

    return prepare


if __name__ == "__main__":
    e2e_runner.main(prepare_for, key="hooks")
