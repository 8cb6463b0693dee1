"""One trainer rank under ``python -m launch.torchrun``, with a test's fault injected (issue #25).

    python -m launch.torchrun --standalone --nproc-per-node 2 tests/stop_runner.py FAULTS_JSON \
        --config configs/tiny_dense.yaml [train args and overrides ...]

Runs ``megatron_acrl.train.main`` (its exit code is this process's) with a ``prepare`` hook that
acts during the k-th optimizer step of rank ``faults["rank"]`` (default 0), after the step's
training and before it is logged. First it writes ``faults["marker"]``: JSON with this rank's pid,
its process group and the pids of its child processes (megatron's checkpoint writer among them).
(with their create times). Then, per ``faults["action"]``:

``pause``     wait until this rank has received a stop signal (the entry point's handler saw it),
              so that the test's signal to the *launcher* is known to land during step k;
``sigkill``   SIGKILL this rank (a crash, the out-of-memory killer).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import torch

import megatron_acrl.train as train
from megatron_acrl.batch.rollout_batch import build_batch, save_rollouts
from megatron_acrl.world.signals import StopSignals

PAUSE_LIMIT_S = 600.0
"""A pause that sees no signal this long fails the run (the test's signal never arrived)."""


def record_rollouts(out: Path, steps: int) -> Path:
    """``steps`` recorded batches (2 prompts x 4 samples of 4 tokens, mixed rewards) in ``out``: what
    the ranks replay with ``--load-rollouts`` (``rollout.prompts_per_step=2``,
    ``n_samples_per_prompt=4``), no server needed."""
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        n = 8
        batch = build_batch(
            [torch.randint(3, 300, (4,), generator=g).tolist() for _ in range(n)],
            [torch.randint(3, 300, (4,), generator=g).tolist() for _ in range(n)],
            [(-2.0 - torch.rand(4, generator=g)).tolist() for _ in range(n)],
            rewards=[float(i % 2) for i in range(n)],
            group_ids=[2 * step + i // 4 for i in range(n)],
            pad_id=0,
        )
        save_rollouts(batch, out, step)
    return out


def inject(faults: dict, received: list[int]):
    def prepare(ctx) -> None:
        if ctx.rank != faults.get("rank", 0):
            return
        train_step, count = ctx.policy.train_step, {"n": 0}

        def faulty(batch):
            out = train_step(batch)
            count["n"] += 1
            if count["n"] == faults["at_train_step"]:
                me = psutil.Process()
                info = {
                    "pid": me.pid,
                    "pgid": os.getpgid(0),
                    "children": {p.pid: p.create_time() for p in me.children(recursive=True)},
                }
                tmp = Path(faults["marker"] + ".tmp")
                tmp.write_text(json.dumps(info))
                tmp.replace(faults["marker"])
                if faults["action"] == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                deadline = time.monotonic() + PAUSE_LIMIT_S
                while not received and time.monotonic() < deadline:
                    time.sleep(0.02)  # the stop signal's handler runs between these sleeps
                if not received:
                    raise RuntimeError(f"no stop signal within {PAUSE_LIMIT_S} s of the pause")
            return out

        ctx.policy.train_step = faulty

    return prepare


def run_with_faults(faults: dict, argv: list[str]) -> int:
    """``megatron_acrl.train.main(argv)`` with ``faults`` injected (see module doc)."""
    received: list[int] = []
    handle = StopSignals.handle

    def noting(self, signum, frame):  # the entry point's own handler, and a note for the pause
        received.append(signum)
        return handle(self, signum, frame)

    StopSignals.handle = noting  # type: ignore[method-assign]
    run = train.run
    if faults:
        train.run = lambda cfg, args, prepare=None: run(cfg, args, prepare=inject(faults, received))
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(run_with_faults(json.loads(sys.argv[1]), sys.argv[2:]))
