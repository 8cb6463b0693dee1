"""The mismatch study: a grid of arms x seeds through the real loop, then a report with plots.

    python -m megatron_acrl.study configs/study/smoke.yaml --out runs/study-smoke --report docs/study

A grid file names a base config, overrides common to every run, the seeds, and the arms (each a
list of overrides, e.g. BF16 rollout, FP8 with none / tis / seq_mis / icepop / acrl). Every run is
``python -m megatron_acrl.train`` in its own process (torchrun when the layout has several ranks),
so arms share nothing but the cached supervised warm-start. The report (``REPORT.md``) has the
paper's table -- peak and mean-of-last-20% reward per arm, mean +- std over seeds, collapsed yes/no
-- and PNG curves of the per-arm mean over seeds, drawn from the runs' ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_acrl.config import ConfigError, load_config
from megatron_acrl.logging import read_jsonl_metrics
from megatron_acrl.plots import plot_runs

COLLAPSE_FRACTION = 0.5
"""An arm-seed has collapsed when its mean reward over the last 20% of steps falls below this fraction
of its own peak (after a 5-step moving average)."""


@dataclass(frozen=True)
class Grid:
    base: str
    common: tuple[str, ...]
    seeds: tuple[int, ...]
    arms: dict[str, tuple[str, ...]]
    ranks: int = 1


def load_grid(path: str | Path) -> Grid:
    """Read and validate a grid file: every arm's config must load before anything runs."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    unknown = set(data) - {"base", "common", "seeds", "arms", "ranks"}
    if unknown:
        raise ConfigError(
            [(f"{path}", f"unknown grid keys {sorted(unknown)}; use base, common, seeds, arms, ranks")]
        )
    if not data.get("arms"):
        raise ConfigError([(f"{path}", "a grid needs arms: {name: [overrides...]}")])
    grid = Grid(
        base=str(data["base"]),
        common=tuple(data.get("common", [])),
        seeds=tuple(int(s) for s in data.get("seeds", [1])),
        arms={str(k): tuple(v or []) for k, v in data["arms"].items()},
        ranks=int(data.get("ranks", 1)),
    )
    for arm, overrides in grid.arms.items():
        try:
            load_config(grid.base, [*grid.common, *overrides])
        except ConfigError as err:
            raise ConfigError(
                [(f"arms.{arm}.{p}" if p else f"arms.{arm}", m) for p, m in err.errors]
            ) from None
    return grid


def run_arm(grid: Grid, arm: str, seed: int, out: Path) -> Path:
    """One training run; returns its run directory (skipped when it already finished)."""
    run_dir = out / f"{arm}-s{seed}"
    done = run_dir / "done"
    if done.exists():
        return run_dir
    overrides = [*grid.common, *grid.arms[arm], f"training.seed={seed}", "training.checkpoint_dir=null"]
    if grid.ranks > 1:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={grid.ranks}",
        ]
    else:
        launcher = [sys.executable]
    cmd = [
        *launcher,
        "-m",
        "megatron_acrl.train",
        "--config",
        grid.base,
        "--run-dir",
        str(run_dir),
        *overrides,
    ]
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "train.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise RuntimeError(f"study run {arm} seed {seed} failed (rc={rc}); see {run_dir / 'train.log'}")
    done.write_text("ok\n")
    return run_dir


def _smooth(xs: list[float], k: int = 5) -> list[float]:
    return [statistics.mean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def summarize(rows: list[dict], key: str = "reward/mean") -> dict[str, float]:
    """Peak, mean of the last 20% of steps, and whether the run collapsed."""
    ys = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
    if not ys:
        return {"peak": math.nan, "last20": math.nan, "collapsed": 0.0}
    tail = ys[-max(1, len(ys) // 5) :]
    peak = max(_smooth(ys))
    last = statistics.mean(tail)
    return {"peak": max(ys), "last20": last, "collapsed": float(peak > 0 and last < COLLAPSE_FRACTION * peak)}


def _mean_rows(runs: list[list[dict]]) -> list[dict]:
    """Per-step mean over seeds of every numeric key (steps all seeds reached)."""
    steps = min(len(r) for r in runs)
    out = []
    for i in range(steps):
        keys = set.intersection(*(set(r[i]) for r in runs))
        row = {"step": runs[0][i]["step"]}
        for k in keys:
            vals = [r[i][k] for r in runs]
            if all(isinstance(v, int | float) and math.isfinite(float(v)) for v in vals):
                row[k] = statistics.mean(float(v) for v in vals)
        out.append(row)
    return out


def _fmt(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} +- {statistics.stdev(xs):.3f}"


def write_report(grid: Grid, out: Path, report_dir: Path) -> Path:
    """REPORT.md and PNGs in ``report_dir`` from the finished runs under ``out``."""
    report_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Mismatch study report",
        "",
        f"Generated by `python -m megatron_acrl.study` from {len(grid.arms)} arms x {len(grid.seeds)} seeds "
        f"(base `{grid.base}`, common overrides `{' '.join(grid.common) or '-'}`).",
        "",
        "| arm | peak reward | mean reward, last 20% | eval acc, last | k3 KL, last 20% | collapsed |",
        "|---|---|---|---|---|---|",
    ]
    mean_dirs = []
    for arm in grid.arms:
        runs = [read_jsonl_metrics(out / f"{arm}-s{s}" / "metrics.jsonl") for s in grid.seeds]
        sums = [summarize(r) for r in runs]
        k3 = [summarize(r, "mismatch/k3_kl")["last20"] for r in runs]
        evals = [
            next((float(x["eval/accuracy"]) for x in reversed(r) if "eval/accuracy" in x), math.nan)
            for r in runs
        ]
        collapsed = sum(int(s["collapsed"]) for s in sums)
        peak, last = _fmt([s["peak"] for s in sums]), _fmt([s["last20"] for s in sums])
        lines.append(
            f"| {arm} | {peak} | {last} | {_fmt(evals)} | {_fmt(k3)} "
            f"| {'yes' if collapsed else 'no'} ({collapsed}/{len(sums)}) |"
        )
        d = out / "_mean" / arm
        d.mkdir(parents=True, exist_ok=True)
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _mean_rows(runs)) + "\n")
        mean_dirs.append(d)
    files = plot_runs(mean_dirs, report_dir, labels=list(grid.arms))
    lines += ["", "Curves are the per-arm mean over seeds (light) with a 5-step moving average (dark).", ""]
    lines += [f"![{f.stem}]({f.name})" for f in files]
    lines += [
        "",
        f"A run counts as collapsed when its last-20% mean reward is below {COLLAPSE_FRACTION:.0%} of its "
        "smoothed peak.",
        "",
    ]
    path = report_dir / "REPORT.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_acrl.study", description=__doc__.split("\n")[0])
    ap.add_argument("grid", help="grid YAML in configs/study/")
    ap.add_argument("--out", default="runs/study", help="where the runs go (finished runs are reused)")
    ap.add_argument("--report", default="docs/study", help="where REPORT.md and the plots go")
    args = ap.parse_args(argv)
    try:
        grid = load_grid(args.grid)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    out = Path(args.out)
    for arm in grid.arms:
        for seed in grid.seeds:
            print(f"study: {arm} seed {seed}", flush=True)
            run_arm(grid, arm, seed, out)
    report = write_report(grid, out, Path(args.report))
    print(f"study report: {report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
