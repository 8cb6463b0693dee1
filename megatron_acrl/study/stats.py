"""The study's statistics: per-run summaries, per-arm results over seeds, paired confidence intervals.

Each finished run's ``metrics.jsonl`` (one row per RL step) is summarized into scalars (peak, mean
of the last 20% of steps, collapsed or not, final evals); an arm's :class:`ArmResult` holds one value
per finished seed, in seed order, so two arms are compared seed by seed (:func:`paired_ci`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_acrl.logging import read_jsonl_metrics
from megatron_acrl.study.grid import Grid

COLLAPSE_FRACTION = 0.5
"""An arm-seed has collapsed when its mean reward over the last 20% of steps falls below this fraction
of its own peak (after a 5-step moving average)."""


def smooth(xs: list[float], k: int = 5) -> list[float]:
    """``k``-step trailing moving average (shorter windows at the start)."""
    return [statistics.mean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def summarize(rows: list[dict], key: str = "reward/mean") -> dict[str, float]:
    """Peak (raw and of the 5-step moving average), mean of the last 20% of steps, collapsed or not."""
    ys = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
    if not ys:
        return {"peak": math.nan, "peak_smooth": math.nan, "last20": math.nan, "collapsed": 0.0}
    tail = ys[-max(1, len(ys) // 5) :]
    peak = max(smooth(ys))
    last = statistics.mean(tail)
    return {
        "peak": max(ys),
        "peak_smooth": peak,
        "last20": last,
        "collapsed": float(peak > 0 and last < COLLAPSE_FRACTION * peak),
    }


def mean_rows(runs: list[list[dict]]) -> list[dict]:
    """Per-step mean and std over seeds of every numeric key (steps all seeds reached); the std of
    key ``k`` is under ``k + ":std"``."""
    steps = min(len(r) for r in runs)
    out = []
    for i in range(steps):
        keys = set.intersection(*(set(r[i]) for r in runs))
        row: dict = {"step": runs[0][i]["step"]}
        for k in keys:
            vals = [r[i][k] for r in runs]
            if all(isinstance(v, int | float) and math.isfinite(float(v)) for v in vals):
                row[k] = statistics.mean(float(v) for v in vals)
                row[k + ":std"] = statistics.stdev(float(v) for v in vals) if len(vals) > 1 else 0.0
        out.append(row)
    return out


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std of the finite values (std 0 for one value; nan, nan for none)."""
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


@dataclass
class ArmResult:
    """One arm's per-seed summaries."""

    arm: str
    method: str
    quantization: str
    peak: list[float]
    last20: list[float]
    collapsed: list[bool]
    eval_acc: list[float]
    k3: list[float]
    rows: list[list[dict]]
    first: list[float] = field(default_factory=list)
    """Sampled reward of the first RL step: every arm of a grid starts from the same weights there, so
    its gap to the BF16 arm is what FP8 sampling alone costs, before any training."""
    served_eval: list[float] = field(default_factory=list)
    """Final ``eval/sampled_reward``: fixed training prompts, sampled from the served (rollout) weights."""
    trainer_eval: list[float] = field(default_factory=list)
    """Final ``eval_trainer/sampled_reward``: the same prompts sampled from the trainer's unquantized
    weights, i.e. what training learned, without what FP8 sampling loses."""
    seeds: list[int] = field(default_factory=list)
    """The finished seeds, in the order of the lists above."""


def collect(grid: Grid, out: Path) -> list[ArmResult]:
    """Summaries of every arm of a finished grid."""
    results = []
    for arm, cfg in grid.configs.items():
        # Only finished runs count (a grid cut short reports the seeds it has; the table says how many).
        seeds = [s for s in grid.seeds if (out / f"{arm}-s{s}" / "done").exists()]
        runs = [read_jsonl_metrics(out / f"{arm}-s{s}" / "metrics.jsonl") for s in seeds]
        if not runs:
            continue
        sums = [summarize(r) for r in runs]
        results.append(
            ArmResult(
                arm=arm,
                method=cfg.correction.method,
                quantization=cfg.rollout.quantization,
                peak=[s["peak_smooth"] for s in sums],
                last20=[s["last20"] for s in sums],
                collapsed=[bool(s["collapsed"]) for s in sums],
                eval_acc=[final(r, "eval/accuracy") for r in runs],
                k3=[summarize(r, "mismatch/k3_kl")["last20"] for r in runs],
                first=[float(r[0].get("reward/mean", math.nan)) for r in runs],
                served_eval=[final(r, "eval/sampled_reward") for r in runs],
                trainer_eval=[final(r, "eval_trainer/sampled_reward") for r in runs],
                rows=runs,
                seeds=seeds,
            )
        )
    return results


def final(rows: list[dict], key: str) -> float:
    """The last logged value of ``key`` in a run (nan if it never was)."""
    return next((float(x[key]) for x in reversed(rows) if isinstance(x.get(key), int | float)), math.nan)


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145)
"""Student's t 97.5% quantiles for 1..14 degrees of freedom (a two-sided 95% interval)."""


def paired_ci(diffs: Sequence[float]) -> tuple[float, float] | None:
    """95% confidence interval of the mean of paired differences (Student's t; normal quantile past
    14 degrees of freedom, which the t table would change by < 0.1 of the half-width); None for
    fewer than 2 pairs."""
    n = len(diffs)
    if n < 2:
        return None
    q = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    m, half = statistics.mean(diffs), q * statistics.stdev(diffs) / math.sqrt(n)
    return m - half, m + half


def paired_by_seed(a: ArmResult, b: ArmResult, metric: str) -> tuple[list[float], list[float]]:
    """``a``'s and ``b``'s values of ``metric`` (an ArmResult list) on the seeds both finished with a
    finite value, in ``a``'s seed order (results without seeds pair by position)."""
    va, vb = getattr(a, metric), getattr(b, metric)
    sa_, sb_ = a.seeds or list(range(len(va))), b.seeds or list(range(len(vb)))
    common = [
        s for s in sa_ if s in sb_ and math.isfinite(va[sa_.index(s)]) and math.isfinite(vb[sb_.index(s)])
    ]
    return [va[sa_.index(s)] for s in common], [vb[sb_.index(s)] for s in common]
