"""Steps per second of asynchronous RL (K = 1) against the synchronous loop, same config, same run.

    python benchmarks/async_step.py [--config configs/tiny_async.yaml] [--steps 24] [--reps 2]
                                    [--trainer-cpus 0] [--server-cpus 1] [--producer-cpus 1]
                                    [--smoke]

Runs the real driver (``python -m megatron_acrl.train``: Megatron trainer, a real SGLang CPU server)
on ``configs/tiny_async.yaml`` -- tuned so that generating a batch and training on it take
comparable time, as they do at scale -- alternately in ``rollout.mode=sync`` and ``async`` with
``max_staleness=1`` (``--reps`` runs of each, sync first, interleaved: the machine is noisy). The
SGLang server is pinned to ``--server-cpus`` (``rollout.server_cpus``) and the trainer process to
``--trainer-cpus`` (its affinity, inherited by its threads), the layout of a GPU cluster where each
side has its own devices; the async producer's thread (HTTP client, JSON decoding, scoring) runs
on ``--producer-cpus`` (``rollout.producer_cpus``; default the server's cores, ``""``: the
trainer's), so that the trainer's core computes only, as on a GPU node where the producer has a
host core of its own. The first ``--warmup`` steps of a run are not counted (start-up, the first
batch of an async run that nothing overlapped).

Prints the mean phase times of each mode (``time/rollout`` = generation, or in async the wait for
a batch; ``train`` = pi_old log-probs + optimizer step; ``time/sync``), the trainer thread's CPU
seconds in ``train`` and its seconds waiting for its core (``time/train_cpu``, ``time/train_runq``:
on a loaded machine other processes' share of the trainer's core, the difference between the
modes' train times when their CPU times agree), the idle fractions, the
ideal speedup ``(gen + train + sync) / max(gen, train + sync)`` from the sync runs' own phases,
then ``async speedup: X`` (steps per second, async / sync) last. Goal: >= 0.8 x ideal and >= 1.4.
``--smoke`` is a short run of the same path (a test uses it); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["rollout.prompts_per_step=4", "rollout.max_new_tokens=8", "training.micro_batch_size=8"]


def run_once(mode: str, args: argparse.Namespace, run_dir: Path) -> list[dict]:
    """One driver run in ``mode``; its metrics rows."""
    overrides = [
        f"rollout.mode={mode}",
        "rollout.max_staleness=1",
        f"rollout.server_cpus=[{args.server_cpus}]",
        f"training.num_steps={args.steps}",
        *([f"rollout.producer_cpus=[{args.producer_cpus}]"] if mode == "async" else []),
        "logging.wandb_mode=disabled",
        "logging.console=false",
        *(SMOKE if args.smoke else []),
    ]
    cpus = {int(c) for c in args.trainer_cpus.split(",")}
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus)), "WANDB_SILENT": "true"}
    cmd = [sys.executable, "-m", "megatron_acrl.train", "--config", args.config, "--run-dir", str(run_dir)]
    t0 = time.perf_counter()
    res = subprocess.run(
        [*cmd, *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),  # the trainer's cores (threads inherit)
        # Its own session, as the servers have (they start with start_new_session): with Linux's
        # autogroup, CPU time is shared between sessions first, so a trainer left in this script's
        # session competes with whatever else runs there, while its server does not.
        start_new_session=True,
    )
    if res.returncode != 0:
        raise SystemExit(f"{mode} run failed (rc={res.returncode}):\n{res.stderr[-4000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    print(f"  {mode:5s} run: {len(rows)} steps in {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def summarize(rows: list[dict], warmup: int) -> dict[str, float]:
    """Mean phase times and idle fractions of the measured steps, and their steps per second."""
    kept = rows[warmup:] or rows
    keys = {k for r in kept for k, v in r.items() if isinstance(v, int | float)}
    mean = {k: statistics.fmean(r[k] for r in kept if k in r) for k in keys}
    return {
        "gen": mean["time/rollout"],
        "train": mean["time/logprob"] + mean["time/train"],
        "sync": mean["time/sync"],
        "train_cpu": mean.get("time/train_cpu", float("nan")),
        "train_runq": mean.get("time/train_runq", float("nan")),
        "step": mean["time/step"],
        "steps_per_s": len(kept) / sum(r["time/step"] for r in kept),
        "trainer_idle": mean.get("time/trainer_idle", float("nan")),
        "server_idle": mean.get("time/server_idle", float("nan")),
        "staleness": mean.get("async/staleness_mean", float("nan")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_async.yaml"))
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--reps", type=int, default=2, help="runs of each mode, interleaved")
    ap.add_argument("--warmup", type=int, default=3, help="first steps of a run not counted")
    ap.add_argument("--trainer-cpus", default="0", help="comma-separated cores of the trainer process")
    ap.add_argument("--server-cpus", default="1", help="comma-separated cores of the SGLang server")
    ap.add_argument(
        "--producer-cpus",
        default=None,
        help='cores of the async producer thread, comma-separated (default: --server-cpus; "": trainer\'s)',
    )
    ap.add_argument("--smoke", action="store_true", help="a short run of the same path (no goal figures)")
    args = ap.parse_args()
    if args.producer_cpus is None:
        args.producer_cpus = args.server_cpus
    if args.smoke:
        args.steps, args.reps, args.warmup = 4, 1, 1
    results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="async-step-") as tmp:
        for rep in range(args.reps):
            for mode in ("sync", "async"):
                rows = run_once(mode, args, Path(tmp) / f"{mode}-{rep}")
                results[mode].append(summarize(rows, args.warmup))
    avg = {m: {k: statistics.fmean(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    for mode, a in avg.items():
        print(
            f"{mode:5s}: gen/wait {a['gen']:.3f} s | train {a['train']:.3f} s "
            f"(cpu {a['train_cpu']:.3f}, runq {a['train_runq']:.3f}) | sync {a['sync']:.3f} s | "
            f"step {a['step']:.3f} s | {a['steps_per_s']:.3f} steps/s | "
            f"trainer idle {a['trainer_idle']:.2f} | server idle {a['server_idle']:.2f} | "
            f"staleness {a['staleness']:.2f}"
        )
    s = avg["sync"]
    ideal = (s["gen"] + s["train"] + s["sync"]) / max(s["gen"], s["train"] + s["sync"])
    speedup = avg["async"]["steps_per_s"] / s["steps_per_s"]
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print(f"ideal speedup: {ideal:.3f}")
    print(f"speedup / ideal: {speedup / ideal:.3f}")
    print(f"async speedup: {speedup:.3f}")


if __name__ == "__main__":
    main()
