"""Plots of a run (or several) from their ``metrics.jsonl``: reward, mismatch, ACRL state, async.

    python -m megatron_acrl.plots runs/demo [runs/other ...] --out runs/demo/plots

Each figure overlays the runs given, labelled by directory name, with a 5-step moving average over
noisy curves; ``reward_mean_vs_time.png`` draws the reward against the training's own wall-clock
time (the sum of ``time/step``), where a sync and an async run of one config differ
(docs/async.md). ``make demo`` ends with :func:`reward_summary`'s line. The study draws its own
report figures (per-arm means over seeds with a band: :mod:`megatron_acrl.study.report`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

from megatron_acrl.logging import read_jsonl_metrics

PANELS = (
    ("reward/mean", "reward (train, sampled)"),
    ("eval/accuracy", "eval accuracy (greedy)"),
    ("mismatch/k3_kl", "k3 KL(mu || pi_old)"),
    ("mismatch/chi2_token", "chi2 token"),
    ("mismatch/log_ppl_abs_diff", "|log ppl diff|"),
    ("acrl/y_over_x", "ACRL Y / X"),
    ("acrl/alpha_abs_mean", "ACRL |alpha|"),
    ("correction/seq_masked_frac", "masked sequence fraction"),
    ("correction/clip_frac_high", "TIS clipped fraction (high)"),
    ("loss/entropy", "entropy"),
    ("async/staleness_mean", "staleness (versions, per sample)"),
    ("mismatch_lag0/k3_kl", "k3 KL, tokens of lag 0"),
    ("mismatch_lag1plus/k3_kl", "k3 KL, tokens of lag >= 1"),
    ("time/trainer_idle", "trainer idle fraction"),
    ("time/server_idle", "server idle fraction"),
)


def series(rows: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """``(x, y)`` of the finite values of ``key``; ``x``: "step", or "time" (seconds of training so
    far: the cumulative ``time/step``, ending with the step's own)."""
    xs, ys, clock = [], [], 0.0
    for r in rows:
        clock += float(r.get("time/step", 0.0))
        v = r.get(key)
        if isinstance(v, int | float) and math.isfinite(float(v)):
            xs.append(int(r["step"]) if x == "step" else clock)
            ys.append(float(v))
    return xs, ys


def plot_runs(
    run_dirs: Sequence[str | Path], out_dir: str | Path, labels: Sequence[str] | None = None
) -> list[Path]:
    """One PNG per panel that any run has data for; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = [read_jsonl_metrics(Path(d) / "metrics.jsonl") for d in run_dirs]
    names = list(labels) if labels else [Path(d).name for d in run_dirs]
    written = []
    panels = [(key, title, "step") for key, title in PANELS]
    if any(r.get("time/step") for rows in runs for r in rows):
        panels.append(("reward/mean", "reward (train, sampled) vs training time", "time"))
    for key, title, x in panels:
        curves = [(n, *series(rows, key, x)) for n, rows in zip(names, runs, strict=True)]
        if not any(xs for _, xs, _ in curves):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for name, xs, ys in curves:
            if not xs:
                continue
            line = ax.plot(xs, ys, label=name, alpha=0.35 if len(xs) >= 10 else 1.0)[0]
            if len(xs) >= 10:  # RL curves are noisy: overlay a 5-step moving average
                k = 5
                avg = [
                    sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1])
                    for i in range(len(ys))
                ]
                ax.plot(xs, avg, color=line.get_color(), label=f"{name} (5-step mean)")
        ax.set_title(title)
        ax.set_xlabel("RL step" if x == "step" else "seconds of training (sum of time/step)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / (key.replace("/", "_") + ("" if x == "step" else "_vs_time") + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def reward_summary(run_dir: str | Path, window: int = 5) -> str | None:
    """``reward (train, mean of first 5 -> last 5 steps): 0.34 -> 0.44 (+0.10)``; None without data."""
    _, ys = series(read_jsonl_metrics(Path(run_dir) / "metrics.jsonl"), "reward/mean")
    if len(ys) < 2:
        return None
    k = max(1, min(window, len(ys) // 2))
    first, last = sum(ys[:k]) / k, sum(ys[-k:]) / k
    span = f"mean of first {k} -> last {k} steps"
    return f"reward (train, {span}): {first:.3f} -> {last:.3f} ({last - first:+.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_acrl.plots", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    ap.add_argument("--out", default=None, help="output directory (default: <first run>/plots)")
    args = ap.parse_args(argv)
    out = args.out or str(Path(args.runs[0]) / "plots")
    from megatron_acrl.rollout.evaluate import exact_j_summary  # the driver's evaluation (torch) only here

    files = plot_runs(args.runs, out)
    print(f"{len(files)} plots in {out}")
    for run in args.runs:
        for line in (reward_summary(run), exact_j_summary(run)):
            if line:
                print(f"{Path(run).name}: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
