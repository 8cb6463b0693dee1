"""Launch a gloo process group of N local ranks running one scenario of ``tests/mcore_worker.py``.

Start-up (Python + megatron import, ~5 s per process) dominates CPU runs, so each scenario runs many
cases inside one launch. Each rank writes ``rank_<r>.pt``; :func:`launch` returns them in rank order.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

WORKER = Path(__file__).with_name("mcore_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_RETRIES = 3
"""Relaunches of a scenario whose rendezvous port was taken before rank 0 bound it."""


class _PortTaken(RuntimeError):
    """A launch failed only because its rendezvous port was taken."""


def launch(
    scenario: str,
    world_size: int,
    args: dict[str, Any] | None = None,
    timeout: float = 600,
    worker: Path = WORKER,
) -> list[Any]:
    """Run ``scenario`` of ``worker`` on ``world_size`` gloo ranks; return each rank's result object.

    The rendezvous port is picked free and bound later by rank 0, so another process can take it in
    between (the test session runs SGLang servers that grab ports): a launch that failed only because
    the port was taken is retried on a fresh one, at most ``PORT_RETRIES`` times."""
    for attempt in range(PORT_RETRIES + 1):
        try:
            return _launch_once(scenario, world_size, args, timeout, worker)
        except _PortTaken:
            if attempt == PORT_RETRIES:
                raise
    raise AssertionError("unreachable")


def _launch_once(
    scenario: str, world_size: int, args: dict[str, Any] | None, timeout: float, worker: Path
) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix=f"mcore_{scenario}_") as out:
        port = _free_port()
        procs = []
        logs = []
        for rank in range(world_size):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                PYTHONWARNINGS="ignore",
            )
            log = open(Path(out) / f"log_{rank}.txt", "w+")  # noqa: SIM115 - closed below
            logs.append(log)
            cmd = [sys.executable, str(worker), scenario, json.dumps(args or {}), out]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        deadline = time.monotonic() + timeout
        failed = None
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                failed = "timeout"
                break
            if any(p.poll() not in (None, 0) for p in procs):
                failed = "a rank failed"
                time.sleep(2)  # let the others report their side
                break
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if failed is None and any(p.returncode != 0 for p in procs):
            failed = "a rank failed"
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
            log.close()
        if failed:
            tails = "\n".join(
                f"--- rank {r} (rc={procs[r].returncode}) ---\n{t[-4000:]}" for r, t in enumerate(texts)
            )
            msg = f"scenario {scenario!r} on {world_size} ranks: {failed}\n{tails}"
            if any("address already in use" in t.lower() for t in texts):
                raise _PortTaken(msg)
            raise RuntimeError(msg)
        return [torch.load(Path(out) / f"rank_{r}.pt", weights_only=False) for r in range(world_size)]


def update_mismatches(ref: dict, got: dict) -> list[str]:
    """Parameters whose first optimizer update differs from the reference beyond fp32 rounding.

    ``ref``/``got`` hold ``init`` and ``after`` dicts of full (gathered) parameters by name.
    """
    bad = []
    for name, after in ref["after"].items():
        delta_ref = after - ref["init"][name]  # ~ -grad (first Adam step, eps >> |g|)
        delta = got["after"][name] - ref["init"][name]
        scale = delta_ref.abs().max().item()
        err = (delta - delta_ref).abs().max().item()
        # Both updates are read off fp32 parameters: each is known only to one ulp of the parameter
        # (1.19e-7 for a layer norm weight near 1), whatever the update's own size.
        ulp = torch.finfo(torch.float32).eps * after.abs().max().item()
        if err > 1e-4 * max(scale, 1e-3) + 2 * ulp:
            bad.append(f"update of {name}: max err {err:.2e} (|grad| {scale:.2e})")
    return bad
