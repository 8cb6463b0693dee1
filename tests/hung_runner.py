"""A driver run whose SGLang server hangs in the middle of a weight sync (issue #25).

    python tests/hung_runner.py SPEC.json

SPEC as :mod:`e2e_runner`'s, with ``"hooks": {"sigstop_at_sync": VERSION}``: when the sync to
VERSION posts its first bucket, server 0's whole process group is stopped with SIGSTOP (it then
never joins the broadcast nor answers anything), and stays stopped. At the end, before the servers
stop, ``<run_dir>/hung.json`` records what the test checks: the stopped processes (gone?), whether
the bridge's registry still holds the stopped server, and the served weights compared with the
trainer's (verify mode) and with the initial checkpoint's.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import e2e_runner  # this directory is on sys.path: the runner is run as a script from it

from sglang_bridge import proctree, server
from sglang_bridge.client import SGLangClient
from sglang_bridge.hf_reference import hf_logprobs, load_hf
from sglang_bridge.weight_sync import DistributedWeightSynchronizer

PROMPTS = [[5, 17, 42, 99, 7, 120, 33], [3, 1, 4, 1, 5, 9, 2, 6], [200, 201, 202]]


def _freeze_at(ctx, version: str, seen: dict) -> None:
    """SIGSTOP server 0's process group as the sync to ``version`` posts its first bucket."""
    update, post = ctx.servers.update_weights, DistributedWeightSynchronizer._post_bucket
    armed = {"on": False}

    def watched(named_tensors, v, **kw):
        armed["on"] = v == version and "pids" not in seen
        return update(named_tensors, v, **kw)

    def freezing(self, bucket, idx):
        if armed["on"]:
            armed["on"] = False
            victim = ctx.servers.servers[0]
            seen["pids"] = [victim.pid, *(p for p, _ in proctree.descendants(victim.pid))]
            seen["server"] = victim
            os.killpg(victim.pid, signal.SIGSTOP)  # the whole server: HTTP front end and scheduler
        return post(self, bucket, idx)

    ctx.servers.update_weights = watched
    DistributedWeightSynchronizer._post_bucket = freezing


def _report(ctx, seen: dict, out: Path) -> None:
    """What became of the stopped server, and whose weights the servers hold now."""
    import asyncio

    servers = ctx.servers
    trainer = load_hf(ctx.model_dir, dict(ctx.policy.hf_weights(all_stages=True)))
    initial = load_hf(ctx.model_dir)
    sync = servers.synchronizer

    async def version(url: str) -> str:
        async with SGLangClient(url, api_key=servers.api_key, timeout_s=30) as c:
            return await c.weight_version()

    report = {
        "stopped_pids": seen.get("pids", []),
        "still_running": [p for p in seen.get("pids", []) if proctree.alive(p)],
        "in_registry": seen.get("server") in server._LIVE,
        "replaced": seen.get("server") is not None and seen["server"] not in servers.servers,
        "versions": [asyncio.run(version(u)) for u in servers.urls],
        "delta_trainer": sync.verify(PROMPTS, lambda p, o, t: hf_logprobs(trainer, p, o, t)).max_abs_delta,
        "delta_initial": sync.verify(PROMPTS, lambda p, o, t: hf_logprobs(initial, p, o, t)).max_abs_delta,
    }
    out.write_text(json.dumps(report, indent=1))


def prepare_for(hooks: dict):
    def prepare(ctx):
        if ctx.servers is None or "sigstop_at_sync" not in hooks:
            return
        seen: dict = {}
        _freeze_at(ctx, hooks["sigstop_at_sync"], seen)
        close = ctx.close

        def reported_close():
            if ctx.servers is not None and sys.exc_info()[0] is None:  # not after a failed run
                _report(ctx, seen, ctx.run_dir / "hung.json")
            close()

        ctx.close = reported_close

    return prepare


if __name__ == "__main__":
    e2e_runner.main(prepare_for, key="hooks")
