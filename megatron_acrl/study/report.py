"""The study's report: the goal verdicts stated with their numbers, the per-grid tables and figures.

:func:`write_report` writes ``REPORT.md`` and one PNG per grid and panel from the finished runs under
``--out`` (nothing in it is edited by hand; ``--report-only`` regenerates it byte for byte from the
same runs). Sections, in order: how it was run (wall times); each exact grid's section
(:mod:`megatron_acrl.study.exact_report`: verdicts, table, differences, figures, its pilot); then the
reward grids': the columns, the goal verdict at a glance, the same comparisons on the trainer's own
weights (when logged), then one section per grid. When no reward grid is in the invocation, the first
study's section is carried over unchanged from :data:`FIRST_STUDY` (its runs are not kept).
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from megatron_acrl.study.exact import collect_exact
from megatron_acrl.study.exact_report import exact_section, save_figure
from megatron_acrl.study.grid import Grid, load_grid
from megatron_acrl.study.stats import (
    COLLAPSE_FRACTION,
    ArmResult,
    collect,
    mean_rows,
    mean_std,
    paired_by_seed,
    paired_ci,
    smooth,
)

PANELS = (
    ("reward/mean", "reward (train, sampled)"),
    ("eval/sampled_reward", "eval reward, fixed train prompts (served weights)"),
    ("eval_trainer/sampled_reward", "eval reward, fixed train prompts (trainer's weights)"),
    ("mismatch/k3_kl", "k3 KL(mu || pi_old)"),
    ("mismatch/chi2_token", "chi2 token"),
    ("mismatch/chi2_seq", "chi2 sequence"),
    ("acrl/alpha_mean", "ACRL alpha (mean)"),
    ("acrl/y_over_x", "ACRL Y / X"),
    ("correction/seq_masked_frac", "masked sequence fraction (seq_mis)"),
    ("correction/mask_frac_high", "IcePop masked token fraction (high)"),
    ("correction/mask_frac_low", "IcePop masked token fraction (low)"),
    ("correction/clip_frac_high", "TIS clipped token fraction"),
    ("loss/entropy", "entropy"),
)
"""Report figures: metric key and title; a figure is drawn when any arm logged the key."""

COLUMNS = (
    "Columns: reward is the sampled training reward (fraction of correct completions in the step's "
    "rollout batch, temperature 1). *peak* is the maximum of its 5-step moving average; *last 20%* the "
    "mean over the last 20% of steps; both mean +- std over seeds. *step 1* is the first step's "
    "sampled reward: every arm starts from the same warm-start weights, so its gap to the BF16 arm is "
    "what FP8 sampling alone costs before any training. *greedy acc* is the final greedy "
    "accuracy on the held-out split. *eval: served / trainer* is the sampled reward at the final eval "
    "on a fixed set of training prompts (`training.eval_samples` samples each, temperature 1), "
    "sampled from the served rollout weights and from the trainer's own unquantized weights "
    "(`training.eval_trainer_weights`: pushed to the same server for the eval, then the rollout copy "
    "is pushed back; the server's KV-cache dtype still applies): the second separates what training "
    "learned from what FP8 sampling loses. "
    f"*collapsed*: last-20% mean below {COLLAPSE_FRACTION:.0%} of the "
    "run's smoothed peak (runs collapsed / seeds)."
)
"""The paragraph that explains the table columns."""


# -- verdicts -------------------------------------------------------------------------------------


def compare(a: ArmResult, b: ArmResult, strict: bool, metric: str = "last20") -> str:
    """``a`` vs ``b`` on ``metric`` (an ArmResult list: mean-of-last-20% reward by default) over the
    seeds both finished (paired by seed), with the numbers, the 95% CI of the paired difference and
    the per-seed wins; fewer than 3 common seeds is said to be no result over seeds."""
    xa, xb = paired_by_seed(a, b, metric)
    if not xa:
        return f"`{a.arm}` vs `{b.arm}`: **no common finished seed**, no comparison"
    (ma, sa), (mb, sb) = mean_std(xa), mean_std(xb)
    ok = ma > mb if strict else ma >= mb
    wins = sum(x > y if strict else x >= y for x, y in zip(xa, xb, strict=True))
    sign = ">" if strict else ">="
    few = "" if len(xa) >= 3 else f"; only {len(xa)} common seed(s): not a result over seeds"
    ci = paired_ci([x - y for x, y in zip(xa, xb, strict=True)])
    ci_txt = f", 95% CI {ci[0]:+.3f} to {ci[1]:+.3f}" if ci else ""
    return (
        f"`{a.arm}` {ma:.3f} +- {sa:.3f} vs `{b.arm}` {mb:.3f} +- {sb:.3f}: "
        f"**{'yes' if ok else 'no'}** (difference {ma - mb:+.3f}{ci_txt}; {sign} on {wins}/{len(xa)} "
        f"seeds, paired by seed{few})"
    )


def verdict(grid: Grid, results: list[ArmResult], metric: str = "last20") -> list[str]:
    """The goal, stated per grid: ACRL >= BF16 rollout; in a stress grid also ACRL > TIS and > MIS
    (on mean-of-last-20% reward, or on another ArmResult list ``metric``)."""
    base = [r for r in results if r.quantization == "none"]
    acrl = [r for r in results if r.method == "acrl" and r.quantization != "none"]
    lines = []
    if not base or not acrl:
        return ["(no BF16-rollout baseline or no ACRL arm in this grid: no verdict)"]
    if not any(math.isfinite(x) for r in results for x in getattr(r, metric)):
        return [f"(no arm logged {metric}: no verdict)"]
    for a in acrl:
        lines.append(f"- ACRL >= BF16 rollout: {compare(a, base[0], False, metric)}")
        if grid.stress:
            for method, label in (("tis", "TIS"), ("seq_mis", "MIS")):
                for other in (r for r in results if r.method == method):
                    lines.append(f"- ACRL > {label}: {compare(a, other, True, metric)}")
    none = [r for r in results if r.method == "none" and r.quantization != "none"]
    for n in none:
        collapsed = (
            f"; collapsed in {sum(n.collapsed)}/{len(n.collapsed)} seeds" if metric == "last20" else ""
        )
        lines.append(
            f"- Uncorrected FP8 >= BF16 rollout (i.e. no degradation): "
            f"{compare(n, base[0], False, metric)}{collapsed}."
        )
    return lines


# -- figures --------------------------------------------------------------------------------------


def plot_grid(grid: Grid, results: list[ArmResult], report_dir: Path) -> list[Path]:
    """One PNG per panel: the per-arm mean over seeds (5-step moving average; eval metrics, logged
    every few steps, unsmoothed with markers), +- one std band on the training reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    means = {r.arm: mean_rows(r.rows) for r in results}
    for key, title in PANELS:
        if not any(key in row for rows in means.values() for row in rows):
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for arm, rows in means.items():
            pts = [(int(r["step"]), r[key], r.get(key + ":std", 0.0)) for r in rows if key in r]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            sparse = len(pts) < len(rows) // 2  # logged every few steps (evals): drawn as is, with markers
            ys = [p[1] for p in pts] if sparse else smooth([p[1] for p in pts])
            sd = [p[2] for p in pts] if sparse else smooth([p[2] for p in pts])
            (line,) = ax.plot(xs, ys, label=arm, lw=1.4, marker="o" if sparse else None, ms=3)
            if key.endswith("reward/mean"):  # the band only where it is read: the training reward
                lo = [y - s for y, s in zip(ys, sd, strict=True)]
                hi = [y + s for y, s in zip(ys, sd, strict=True)]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.08)
        if key.startswith(("mismatch/k3", "mismatch/chi2")):
            ax.set_yscale("symlog", linthresh=1e-5)
        written.append(
            save_figure(
                fig, ax, f"{grid.name}: {title}", report_dir / f"{grid.name}_{key.replace('/', '_')}.png"
            )
        )
    return written


# -- the markdown ---------------------------------------------------------------------------------


def _fmt(xs: Sequence[float], digits: int = 3) -> str:
    m, s = mean_std(xs)
    if math.isnan(m):
        return "-"
    if len(xs) == 1:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} +- {s:.{digits}f}"


def _fmt_sci(xs: Sequence[float]) -> str:
    m, s = mean_std(xs)
    return "-" if math.isnan(m) else f"{m:.2e} +- {s:.1e}"


def _steps(results: list[ArmResult]) -> int:
    return max(len(r) for a in results for r in a.rows) if results else 0


def _intro(grids: Sequence[Grid], note: str) -> list[str]:
    """Title, what generated the report and what a run is, and the caller's note."""
    lines = [
        "# Mismatch study report",
        "",
        "Generated by `python -m megatron_acrl.study "
        + " ".join(f"configs/study/{g.name}.yaml" for g in grids)
        + "` from the runs' `metrics.jsonl` (nothing here is edited by hand). Every run is the real loop: "
        "Megatron-Core trainer (CPU, gloo), SGLang CPU rollout server, the weight-sync bridge. FP8 on a "
        "CPU server is *fake-quant*: the trainer quantizes -> dequantizes and sends bf16 weights, so the "
        "rollout sees FP8 weight rounding, not FP8 activations"
        + (
            "; arms with `rollout.kv_cache_dtype=fp8_e4m3` also round every cached K and V through e4m3 "
            "(SGLang's FP8 KV cache, emulated in the bf16 cache on CPU)."
            if any(c.rollout.kv_cache_dtype != "auto" for g in grids for c in g.configs.values())
            else " or KV cache."
        ),
        "",
    ]
    if note:
        lines += [f"**How this report was run.** {note}", ""]
    return lines


def _wall_times(grids: Sequence[Grid], out: Path, wall_s: float | None) -> list[str]:
    """The invocation's wall time (``wall_s``, or with ``--report-only`` the one recorded in
    ``study_wall.json``), the span from the first run's start to the last run's end, and the runs' own
    wall times, from their ``done`` markers."""
    run_walls, starts, ends = [], [], []
    for g in grids:
        for arm in g.arms:
            for s in g.seeds:
                done = out / f"{arm}-s{s}" / "done"
                with contextlib.suppress(OSError, ValueError, KeyError):
                    w = float(json.loads(done.read_text())["wall_s"])
                    run_walls.append(w)
                    ends.append(done.stat().st_mtime)
                    starts.append(ends[-1] - w)
    lines = []
    wall_file = out / "study_wall.json"
    if wall_s is None and wall_file.exists():  # --report-only: the wall time of the run that made them
        with contextlib.suppress(OSError, ValueError, KeyError):
            wall_s = float(json.loads(wall_file.read_text())["wall_s"])
    if wall_s is not None:
        lines.append(f"Wall time of the grid invocation: {wall_s / 60:.1f} min.")
    if starts:  # holds also when several invocations (--seeds) shared --out concurrently
        lines.append(
            f"First run start to last run end: {(max(ends) - min(starts)) / 60:.1f} min (server start-up "
            "before the first run not included)."
        )
    if run_walls:
        lines.append(
            f"Sum of the {len(run_walls)} runs' own wall times: {sum(run_walls) / 60:.1f} min "
            f"(median {statistics.median(run_walls):.0f} s per run)."
        )
    return lines


def _verdicts(grids: Sequence[Grid], collected: dict[str, list[ArmResult]]) -> list[str]:
    """The goal verdict of every grid at a glance, then the same on the trainer's own weights."""
    lines = [
        "## Goal verdict at a glance",
        "",
        "Each line: the two arms' means +- std over seeds, the verdict on the means, the mean paired "
        "difference with its 95% confidence interval (Student's t over the seeds both arms finished) "
        "and the seeds on which the comparison holds. An interval that contains 0 means these seeds "
        "do not tell the two arms apart.",
        "",
    ]
    for g in grids:
        lines += [f"*{g.title}* (`{g.name}`):", ""]
        lines += verdict(g, collected[g.name])
        lines.append("")
    if any(math.isfinite(x) for res in collected.values() for r in res for x in r.trainer_eval):
        lines += [
            "## The same comparisons on the trainer's own weights (supplementary, not the goal's metric)",
            "",
            "Final-eval sampled reward of each arm's trained policy sampled with its unquantized weights "
            "(*eval: trainer* above; BF16 arms: the served weights are the trainer's). This asks whether "
            "a correction let training learn as well as with BF16 rollouts, apart from the FP8 sampler's "
            "own loss. One eval per run (not a mean over steps), so noisier than the goal's metric.",
            "",
        ]
        for g in grids:
            lines += [f"*{g.title}* (`{g.name}`):", ""]
            lines += verdict(g, collected[g.name], "trainer_eval")
            lines.append("")
    return lines


def _setting(g: Grid, results: list[ArmResult]) -> str:
    """One sentence: the grid's base, seeds, steps, model, batch, algorithm, learning rate and task."""
    cfg = next(iter(g.configs.values()))
    m = cfg.model
    moe = f", {m.num_experts} experts top-{m.moe_router_topk}" if m.is_moe else ""
    return (
        f"Grid `configs/study/{g.name}.yaml`: base `{g.base}`, seeds {list(g.seeds)}, "
        f"{_steps(results)} RL steps, model `{m.family}` ({m.num_layers} layers, hidden "
        f"{m.hidden_size}{moe}"
        + f"), {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.n_samples_per_prompt} samples per "
        f"step, {cfg.algorithm.name} ({cfg.algorithm.ppo_epochs} epoch(s) x "
        f"{cfg.algorithm.num_minibatches} minibatch(es)), lr {cfg.training.lr:g}, task "
        f"{cfg.task.name} ({cfg.task.num_digits} digit(s))."
    )


def _table(g: Grid, results: list[ArmResult]) -> list[str]:
    """The grid's table: one row per arm, mean +- std over its finished seeds."""
    lines = [
        "| arm | overrides | seeds | reward, step 1 | peak reward | reward, last 20% | greedy acc "
        "| eval: served | eval: trainer | k3 KL, last 20% | collapsed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        n = sum(r.collapsed)
        ov = " ".join(g.arms[r.arm]) or "-"
        lines.append(
            f"| {r.arm} | `{ov}` | {len(r.last20)} | {_fmt(r.first)} | {_fmt(r.peak)} | "
            f"{_fmt(r.last20)} | {_fmt(r.eval_acc, 2)} | {_fmt(r.served_eval)} | "
            f"{_fmt(r.trainer_eval)} | {_fmt_sci(r.k3)} | {'yes' if n else 'no'} "
            f"({n}/{len(r.collapsed)}) |"
        )
    return lines


def _grid_section(g: Grid, results: list[ArmResult], report_dir: Path) -> list[str]:
    """One grid: its setting, the table, the verdict, and its figures (written to ``report_dir``)."""
    lines = [f"## {g.title}", ""]
    if g.notes:
        lines += [g.notes, ""]
    lines += [_setting(g, results), "", f"Common overrides: `{' '.join(g.common) or '-'}`", ""]
    lines += _table(g, results)
    lines += ["", "**Goal verdict** (mean-of-last-20% reward, mean +- std over seeds):", ""]
    lines += verdict(g, results)
    lines += ["", "Curves: per-arm mean over seeds, 5-step moving average (reward: +- 1 std band).", ""]
    lines += [f"![{f.stem}]({f.name})" for f in plot_grid(g, results, report_dir)]
    lines.append("")
    return lines


FIRST_STUDY = Path(__file__).resolve().parents[2] / "docs" / "study" / "first_study.md"
"""The first study's section (issue #7: 105 runs of 40 steps, sampled-reward verdicts) as it was
generated from its runs on 2026-11-30, which are not kept; the report carries it over unchanged."""

FIRST_STUDY_NOTE = (
    "*Carried over unchanged* from the report generated from the first study's runs (2026-11-30; "
    "those runs are not on this machine, so this text is not regenerated). Its grids stay runnable "
    "(`make study-first` reruns them and regenerates this section from the runs). Its figures are "
    "the `dense_*`, `dense_stress_*` and `moe_stress_*` PNGs beside this report."
)


def _exact_sections(grids: Sequence[Grid], out: Path, report_dir: Path) -> list[str]:
    lines = []
    for g in grids:
        pilot = None
        if g.pilot:
            pg = load_grid(g.pilot)
            pilot = (pg, collect_exact(pg, out, report_dir))
        lines += exact_section(g, collect_exact(g, out, report_dir), report_dir, pilot)
    return lines


def write_report(
    grids: Sequence[Grid], out: Path, report_dir: Path, wall_s: float | None = None, note: str = ""
) -> Path:
    """REPORT.md and PNGs in ``report_dir`` from the finished runs under ``out`` (exact grids also
    from their archives in ``report_dir``)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    exact = [g for g in grids if g.kind == "exact"]
    reward = [g for g in grids if g.kind != "exact"]
    lines = _intro(grids, note) + _wall_times(grids, out, wall_s) + [""]
    lines += _exact_sections(exact, out, report_dir)
    if reward:
        lines += [COLUMNS, ""]
        collected = {g.name: collect(g, out) for g in reward}
        lines += _verdicts(reward, collected)
        for g in reward:
            lines += _grid_section(g, collected[g.name], report_dir)
    elif FIRST_STUDY.is_file():
        lines += ["## The first study (issue #7): FP8 rollout at 40 steps, sampled-reward verdicts", ""]
        lines += [FIRST_STUDY_NOTE, "", FIRST_STUDY.read_text().rstrip("\n"), ""]
    path = report_dir / "REPORT.md"
    path.write_text("\n".join(lines))
    return path
