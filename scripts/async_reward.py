"""Reward parity of async RL: the demo's config in sync and in async (K = 1), both curves in one figure.

    python scripts/async_reward.py [--config configs/demo.yaml] [--out-dir runs/async-reward]
                                   [--figure docs/async_reward.png] [--steps N] [--parallel]
                                   [section.key=value ...]

Runs the real driver (``python -m launch.torchrun ... -m megatron_acrl.train``, as ``make demo``)
twice, ``rollout.mode=sync`` and ``rollout.mode=async rollout.max_staleness=1``, each with its own
run and checkpoint directory (a shared one would make the second run resume the first), then draws
the sampled reward per step of both runs (the raw curve and its 5-step mean, from
:func:`megatron_acrl.plots.series`) and, when the config logs it (``training.exact_eval_interval``),
the exact expected reward J of the trainer's weights at its evaluation steps, into ``--figure``.
Prints a markdown table (first-5 and last-5 mean reward, the last exact J, steps per second) for
docs/async.md. ``--parallel`` runs the two modes side by side (half the wall time; their speeds then
mean nothing, their curves still do). ``--report-only`` redraws from runs already in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": ["rollout.mode=sync"], "async": ["rollout.mode=async", "rollout.max_staleness=1"]}


def command(config: str, run_dir: Path, mode: str, args: argparse.Namespace) -> list[str]:
    """The driver's command line for ``mode`` (``make demo``'s launcher, its own checkpoints)."""
    over = [*MODES[mode], f"training.checkpoint_dir={run_dir / 'checkpoints'}", "logging.wandb_mode=disabled"]
    if args.steps is not None:
        over.append(f"training.num_steps={args.steps}")
    over += args.overrides
    nproc = args.nproc
    launch = [sys.executable, "-m", "launch.torchrun", "--standalone", f"--nproc-per-node={nproc}"]
    return [*launch, "-m", "megatron_acrl.train", "--config", config, "--run-dir", str(run_dir), *over]


def run_modes(args: argparse.Namespace, out: Path) -> None:
    """Both runs (sequential, or side by side with ``--parallel``); a failed run stops the script."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    procs = []
    for mode in MODES:
        run_dir = out / mode
        if (run_dir / "checkpoints").exists():
            raise SystemExit(f"{run_dir} holds a previous run: remove it, or pass --report-only")
        run_dir.mkdir(parents=True, exist_ok=True)
        log = (run_dir / "driver.log").open("w")
        cmd = command(args.config, run_dir, mode, args)
        print(f"{mode}: {' '.join(cmd)}", flush=True)
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((mode, p, run_dir))
        if not args.parallel:
            p.wait()
    for mode, p, run_dir in procs:
        if p.wait() != 0:
            raise SystemExit(f"{mode} run failed (rc={p.returncode}); see {run_dir / 'driver.log'}")


def curves(out: Path) -> dict[str, list[dict]]:
    from megatron_acrl.logging import read_jsonl_metrics

    return {mode: read_jsonl_metrics(out / mode / "metrics.jsonl") for mode in MODES}


def draw(runs: dict[str, list[dict]], figure: Path) -> None:
    """Reward per step (raw and 5-step mean) of each mode; the exact J beside it when logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_acrl.plots import series

    has_j = any(series(rows, "eval/exact_j")[0] for rows in runs.values())
    fig, axes = plt.subplots(1, 2 if has_j else 1, figsize=(11 if has_j else 6, 3.8), squeeze=False)
    for mode, rows in runs.items():
        xs, ys = series(rows, "reward/mean")
        line = axes[0][0].plot(xs, ys, alpha=0.3, label=mode)[0]
        avg = [sum(ys[max(0, i - 4) : i + 1]) / len(ys[max(0, i - 4) : i + 1]) for i in range(len(ys))]
        axes[0][0].plot(xs, avg, color=line.get_color(), label=f"{mode} (5-step mean)")
        if has_j:
            jx, jy = series(rows, "eval/exact_j")
            axes[0][1].plot(jx, jy, marker="o", color=line.get_color(), label=mode)
    axes[0][0].set_title("sampled reward per RL step (async: K = 1)")
    if has_j:
        axes[0][1].set_title("exact expected reward J (trainer weights)")
    for ax in axes[0]:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110)
    plt.close(fig)


def table(runs: dict[str, list[dict]]) -> str:
    """Markdown: per mode, steps, first-5 -> last-5 mean reward, exact J first -> last, steps/s."""
    from megatron_acrl.plots import series

    lines = [
        "| mode | steps | reward, first 5 | reward, last 5 | exact J first -> last | steps/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode, rows in runs.items():
        _, ys = series(rows, "reward/mean")
        _, js = series(rows, "eval/exact_j")
        _, ts = series(rows, "time/step")
        k = max(1, min(5, len(ys) // 2))
        j = f"{js[0]:.3f} -> {js[-1]:.3f}" if len(js) >= 2 else "-"
        rate = f"{len(ts) / sum(ts):.3f}" if ts else "-"
        first, last = sum(ys[:k]) / k, sum(ys[-k:]) / k
        lines.append(f"| {mode} | {len(ys)} | {first:.3f} | {last:.3f} | {j} | {rate} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--out-dir", default="runs/async-reward")
    ap.add_argument("--figure", default="docs/async_reward.png")
    ap.add_argument("--steps", type=int, default=None, help="training.num_steps (default: the config's)")
    ap.add_argument("--nproc", type=int, default=2, help="trainer ranks (the demo: 2, its parallel.tp)")
    ap.add_argument("--parallel", action="store_true", help="run the two modes side by side")
    ap.add_argument("overrides", nargs="*", help="more dotted overrides for both runs")
    ap.add_argument("--report-only", action="store_true", help="redraw from the runs in --out-dir")
    args = ap.parse_args()
    out = (ROOT / args.out_dir).resolve()
    if not args.report_only:
        run_modes(args, out)
    runs = curves(out)
    draw(runs, ROOT / args.figure)
    print(table(runs))
    print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
