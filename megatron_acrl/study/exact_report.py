"""The report section of an exact grid (and of its pilot): the verdicts in the issue's order, the
per-arm table, the paired differences, the figures, the pilot's numbers and the choices made.

Everything is computed from :mod:`megatron_acrl.study.exact`'s summaries, so the section is the same
whether the runs are under ``--out`` or only in the grid's archive.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_acrl.config import Config
from megatron_acrl.study import sweep, verdicts
from megatron_acrl.study.exact import ExactArm, series
from megatron_acrl.study.grid import ROLES, Grid
from megatron_acrl.study.replay import replay
from megatron_acrl.study.stats import mean_std, smooth

PANELS = (
    ("eval/exact_j", "exact J, trainer's weights (solid) and served copy (dashed)", "eval/exact_j_served"),
    ("reward/mean", "sampled training reward", None),
    ("mismatch/k3_kl", "k3 KL(mu || pi_old)", None),
    ("mismatch/chi2_token", "chi2 token", None),
    ("grad_norm", "gradient norm before clipping", None),
    ("loss/entropy", "entropy", None),
    ("acrl/y_over_x", "ACRL Y / X", None),
    ("correction/weight_max", "largest correction weight (ACRL, TIS)", None),
)
"""Figures: metric, title, and a companion metric drawn dashed in the same colour."""

COLUMNS = (
    "Columns: *J trainer* / *J served* are the exact expected reward J (mean over the 100 prompts of "
    "P(answer + EOS | prompt), teacher-forced) on the trainer's weights and on the copy the servers "
    "hold (stress-quantized, FP8 KV cache, lagged), each the mean of the run's last 20% of exact "
    "evals, then mean +- std over seeds. *gap, step 1 / end*: served minus trainer J at the first "
    "eval (the warm start: what the stress costs before any training and any lag) and at the last. "
    "*reward* is the sampled training reward over the last 20% of steps. *k3* its mean over the "
    "first and the last 20% of steps. *max w*: the largest correction weight of any step (ACRL's "
    "or TIS's), *max Y/X* ACRL's largest ratio. *failed*: runs that did not finish (counted as J = 0)."
)


def _fmt(xs: Sequence[float], digits: int = 3) -> str:
    m, s = mean_std(xs)
    if math.isnan(m):
        return "-"
    return f"{m:.{digits}f}" if len(xs) == 1 else f"{m:.{digits}f} +- {s:.{digits}f}"


def _sci(xs: Sequence[float]) -> str:
    m, _ = mean_std(xs)
    return "-" if math.isnan(m) else f"{m:.2g}"


def _maxf(xs: Sequence[float]) -> str:
    finite = [x for x in xs if math.isfinite(x)]
    return f"{max(finite):.3g}" if finite else "-"


def _role_of(grid: Grid) -> dict[str, str]:
    return {arm: role for role, arm in grid.roles.items()}


def table(grid: Grid, arms: list[ExactArm]) -> list[str]:
    """One row per arm: exact J on both weights, the gaps, reward, k3, weights, failures."""
    roles = _role_of(grid)
    lines = [
        "| arm | role | seeds | J trainer | J served | gap, step 1 | gap, end | reward "
        "| k3, first -> last 20% | max w | max Y/X | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in arms:
        lines.append(
            f"| {a.arm} | {roles.get(a.arm, '-')} | {len(a.seeds)} | {_fmt(a.j_trainer)} | "
            f"{_fmt(a.j_served)} | {_fmt(a.gap_start)} | {_fmt(a.gap_end)} | {_fmt(a.reward)} | "
            f"{_sci(a.k3_start)} -> {_sci(a.k3_end)} | {_maxf(a.weight_max)} | {_maxf(a.yx_max)} | "
            f"{sum(a.failed)}/{len(a.failed)} |"
        )
    return lines


def differences(grid: Grid, arms: list[ExactArm]) -> list[str]:
    """Every arm minus the BF16 arm (and minus the uncorrected one), on both exact J, paired by seed."""
    by = {a.arm: a for a in arms}
    refs = [(r, by[grid.roles[r]]) for r in ("bf16", "none") if grid.roles.get(r) in by]
    lines = ["| arm | vs | J trainer: difference [95% CI] (wins) | J served: difference [95% CI] (wins) |"]
    lines.append("|---|---|---|---|")
    for a in arms:
        if a.arm == grid.roles.get("bf16"):
            continue  # the reference itself: every other arm's row compares with it
        for _, ref in refs:
            if a.arm == ref.arm:
                continue
            cells = []
            for metric in ("j_trainer", "j_served"):
                p = verdicts.paired(a, ref, metric)
                ci = f" [{p.ci[0]:+.3f}, {p.ci[1]:+.3f}]" if p and p.ci else ""
                cells.append(f"{p.diff:+.3f}{ci} ({p.wins}/{p.n})" if p else "-")
            lines.append(f"| {a.arm} | {ref.arm} | {cells[0]} | {cells[1]} |")
    return lines


def grid_verdicts(grid: Grid, arms: list[ExactArm]) -> list[str]:
    """The four verdicts in the issue's order (both ACRL arms where both exist), then the extension's."""
    by = {role: a for a in arms for role, arm in grid.roles.items() if arm == a.arm}
    if "bf16" not in by or "none" not in by:
        return ["(no BF16 or no uncorrected arm has finished a run: no verdict)"]
    lines = [f"1. **The stress is real** (uncorrected vs BF16, trainer's exact J): "
             f"{verdicts.stress_is_real(by['bf16'], by['none'])[1]}"]  # fmt: skip
    acrls = [by[r] for r in ("acrl", "acrl_ext") if r in by]
    for n, (title, fn, ref) in enumerate(
        (
            ("ACRL beats uncorrected** (trainer's exact J)", verdicts.beats, "none"),
            (
                "ACRL is non-inferior to BF16 sync** (served exact J, margin 0.05)",
                verdicts.noninferior,
                "bf16",
            ),
            ("ACRL vs TIS** (trainer's exact J)", verdicts.versus_tis, "tis"),
        ),
        start=2,
    ):
        if ref not in by or not acrls:
            # Name the arm that is missing: the ACRL arms first (every verdict needs one), else ref.
            missing = "ACRL" if not acrls else ref
            lines.append(f"{n}. **{title}: no {missing} arm finished a run")
            continue
        parts = [f"`{a.arm}`: {fn(a, by[ref])[1]}" for a in acrls]
        lines.append(f"{n}. **{title}:\n   - " + "\n   - ".join(parts))
    if "acrl" in by and "acrl_ext" in by:
        lines.append(
            "5. **Our extension reaches the paper's arm without its failures** (trainer's exact J, margin "
            f"0.05): {verdicts.extension(by['acrl_ext'], by['acrl'])[1]}"
        )
    return lines


def _mean_by_step(runs: list[list[dict]], key: str) -> tuple[list[int], list[float]]:
    """Per step, the mean over the seeds that logged ``key`` there."""
    at: dict[int, list[float]] = {}
    for rows in runs:
        for step, v in series(rows, key):
            at.setdefault(step, []).append(v)
    steps = sorted(at)
    return steps, [statistics.mean(at[s]) for s in steps]


def plot(grid: Grid, arms: list[ExactArm], report_dir: Path) -> list[Path]:
    """One PNG per panel of :data:`PANELS` that any arm logged: the per-arm mean over seeds (dense
    metrics with a 5-step moving average; the exact evals as logged, with markers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, title, companion in PANELS:
        if not any(series(rows, key) for a in arms for rows in a.rows):
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for a in arms:
            xs, ys = _mean_by_step(a.rows, key)
            if not xs:
                continue
            sparse = key.startswith("eval/")
            (line,) = ax.plot(
                xs, ys if sparse else smooth(ys), label=a.arm, lw=1.4, marker="o" if sparse else None, ms=2
            )
            if companion:
                cx, cy = _mean_by_step(a.rows, companion)
                ax.plot(cx, cy, color=line.get_color(), ls="--", lw=1.0, marker="x", ms=2)
        if key.startswith(("mismatch/", "correction/weight", "acrl/y", "grad_norm")):
            ax.set_yscale("symlog", linthresh=1e-3 if key.startswith("mismatch/") else 1.0)
        written.append(save_figure(fig, ax, f"{grid.name}: {title}", report_dir / _png(grid.name, key)))
    return written


def _png(grid_name: str, key: str) -> str:
    return f"{grid_name}_{key.replace('/', '_')}.png"


def save_figure(fig: Any, ax: Any, title: str, path: Path) -> Path:
    """Title, step axis, grid and legend on a study figure, then write it to ``path`` and close it."""
    import matplotlib.pyplot as plt

    ax.set_title(title, fontsize=9)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _setting(g: Grid, arms: list[ExactArm]) -> str:
    cfg = next(iter(g.configs.values()))
    m, r, t = cfg.model, cfg.rollout, cfg.training
    return (
        f"Grid `configs/study/{g.name}.yaml`: base `{g.base}`, seeds {list(g.seeds)}, "
        f"{t.num_steps} RL steps, model `{m.family}` ({m.num_layers} layers, hidden {m.hidden_size}), "
        f"{r.prompts_per_step} prompts x "
        f"{r.n_samples_per_prompt} samples per step (at most {r.max_new_tokens} new tokens), "
        f"{cfg.algorithm.name} ({cfg.algorithm.ppo_epochs} epoch(s) x {cfg.algorithm.num_minibatches} "
        f"minibatch(es)), lr {t.lr:g}, exact J every {t.exact_eval_interval} steps, task {cfg.task.name} "
        f"({cfg.task.num_digits} digit(s), every prompt trained)."
    )


def _arms_list(g: Grid) -> list[str]:
    roles = _role_of(g)
    out = []
    for arm, ov in g.arms.items():
        role = f" ({ROLES[roles[arm]]})" if arm in roles else ""
        out.append(f"- `{arm}`{role}: `{' '.join(ov) or '-'}`")
    return out


def cost(arms: list[ExactArm]) -> str:
    """The runs' CPU seconds per RL step (trainer + server, load-independent) and wall seconds per step."""
    cpu = [x for a in arms for x in a.cpu_per_step if math.isfinite(x)]
    wall = [x for a in arms for x in a.wall_per_step if math.isfinite(x)]
    if not cpu and not wall:
        return ""
    parts = []
    if cpu:
        parts.append(
            f"CPU per RL step (trainer + server processes, all cores): median {statistics.median(cpu):.2f} s"
        )
    if wall:
        parts.append(f"wall `time/step` median {statistics.median(wall):.2f} s (under the load of the run)")
    return "Cost: " + "; ".join(parts) + "."


CORES = 2
"""The cores the grid estimate spreads CPU seconds over: this machine's, and ``make study``'s --jobs."""


def _cut_short(arms: list[ExactArm]) -> list[str]:
    cut = []
    for a in arms:  # stopped_at is empty for an ExactArm built by hand
        cut += [f"`{a.arm}` seed {s} at step {n}" for s, n in zip(a.seeds, a.stopped_at, strict=False) if n]
    if not cut:
        return []
    return [f"Cut short (kept as run, summarised over the evals they logged): {', '.join(cut)}.", ""]


def _stressed(cfg: Config) -> bool:
    return cfg.rollout.quantization != "none" or cfg.rollout.weight_lag_steps > 0


def estimate(grid: Grid, pilot: Grid, arms: list[ExactArm]) -> str:
    """The grid's wall time on a quiet machine from the pilot's CPU seconds per RL step: every grid run
    costs its steps x the median CPU per step of the pilot's runs of its kind (BF16 sync, or stressed:
    FP8 and / or lag), spread over :data:`CORES` busy cores. Start-up CPU is in the pilot's per-step
    figure and so scales with the steps (conservative for longer runs); the servers' start-up is not."""
    kinds: dict[bool, list[float]] = {True: [], False: []}
    for a in arms:
        kinds[_stressed(pilot.configs[a.arm])] += [x for x in a.cpu_per_step if math.isfinite(x)]
    per = {k: statistics.median(v) for k, v in kinds.items() if v}
    if not per:
        return ""
    total, missing = 0.0, []
    for arm, cfg in grid.configs.items():
        kind = _stressed(cfg)
        if kind not in per:
            missing.append(arm)
            kind = not kind  # the other kind's figure: better than none, and said so
        total += len(grid.seeds) * cfg.training.num_steps * per[kind]
    runs = len(grid.seeds) * len(grid.arms)
    note = f" (no pilot CPU figure for {', '.join(missing)}: the other kind's used)" if missing else ""
    shown = ", ".join(f"{'stressed' if k else 'BF16 sync'} {v:.2f} s" for k, v in sorted(per.items()))
    return (
        f"Grid estimate: {runs} runs, {total / 3600:.2f} CPU hours at the pilot's median CPU per RL step "
        f"({shown}; trainer and servers, load-independent), over {CORES} cores: **about "
        f"{total / CORES / 60:.0f} min** on a quiet machine, plus the servers' start-up{note}."
    )


def _replays(grid: Grid, pilot: Grid, arms: list[ExactArm]) -> list[str]:
    """The grid's ACRL settings replayed (open loop) on the pilot's uncorrected runs' mismatch."""
    settings = [(a, grid.configs[a]) for r in ("acrl", "acrl_ext") if (a := grid.roles.get(r))]
    by = {a.arm: a for a in arms}
    targets = [by[arm] for r in ("none", "bf16_lag") if (arm := pilot.roles.get(r)) in by]
    if not settings or not targets:
        return []
    lines = [
        "ACRL's controller replayed open loop on the pilot's uncorrected runs (`megatron_acrl/study/"
        "replay.py`: the logged mismatch as Y, the bound on the largest weight from the logged log-ratio "
        "range; a controller that trained would change what it then saw):",
        "",
    ]
    for t in targets:
        for seed, rows in zip(t.seeds, t.rows, strict=True):
            lines += [
                f"- `{a}` on `{t.arm}` seed {seed}: "
                f"{replay(rows, c.correction, c.acrl_reference_lag).summary()}"
                for a, c in settings
            ]
    return [*lines, ""]


def pilot_section(pilot: Grid, arms: list[ExactArm], grid: Grid, report_dir: Path) -> list[str]:
    """The pilot's numbers, its go / no-go, and the choices the grid was run with."""
    lines = [f"### The pilot: {pilot.title}", ""]
    if pilot.notes:
        lines += [pilot.notes, ""]
    lines += [_setting(pilot, arms), "", *_arms_list(pilot), ""]
    if not arms:
        return [*lines, "(no pilot run found, neither under --out nor in its archive)", ""]
    lines += table(pilot, arms) + [""]
    by = {role: a for a in arms for role, arm in pilot.roles.items() if arm == a.arm}
    if "bf16" in by and "none" in by:
        lines += [f"Go / no-go: {verdicts.pilot_check(by['bf16'], by['none'])[1]}", ""]
    if "bf16_lag" in by:
        p = verdicts.paired(by["bf16_lag"], by["bf16"], "j_trainer")
        if p is not None:
            lines += [f"The lag alone (BF16 + lag vs BF16 sync, trainer's exact J): {p.text()}.", ""]
    lines += _cut_short(arms)
    if c := cost(arms):
        lines += [c, ""]
    if e := estimate(grid, pilot, arms):
        lines += [e, ""]
    lines += _replays(grid, pilot, arms)
    if grid.choices:
        lines += [
            "**Choices made from the pilot** (written into the grid file before the grid ran):",
            "",
            grid.choices,
            "",
        ]
    lines += [f"![{f.stem}]({f.name})" for f in plot(pilot, arms, report_dir)]
    return [*lines, ""]


def exact_section(
    grid: Grid, arms: list[ExactArm], report_dir: Path, pilot: tuple[Grid, list[ExactArm]] | None
) -> list[str]:
    """The whole section of one exact grid (its figures written to ``report_dir``)."""
    lines = [f"## {grid.title}", ""]
    if grid.notes:
        lines += [grid.notes, ""]
    lines += [
        _setting(grid, arms),
        "",
        f"Common overrides: `{' '.join(grid.common) or '-'}`",
        "",
        "Arms:",
        "",
    ]
    lines += _arms_list(grid) + [""]
    if arms and grid.verdicts:  # issue #34's lag sweep: its pre-registered verdicts and pick table
        lines += sweep.section(grid, arms)
    if arms:
        lines += ["### Verdicts", "", *grid_verdicts(grid, arms), ""]
        lines += ["### Per arm", "", COLUMNS, "", *table(grid, arms), ""]
        lines += ["Paired differences (by seed):", "", *differences(grid, arms), ""]
        if c := cost(arms):
            lines += [c, ""]
        lines += ["Curves: per-arm mean over seeds (dense metrics: 5-step moving average).", ""]
        lines += [f"![{f.stem}]({f.name})" for f in plot(grid, arms, report_dir)] + [""]
    else:
        lines += ["(no run of this grid has finished yet: run `make study`)", ""]
    if pilot is not None:
        lines += pilot_section(pilot[0], pilot[1], grid, report_dir)
    return lines
