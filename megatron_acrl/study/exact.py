"""The exact grids' numbers: each run's rows (from ``--out``, or from the grid's archive), per-run
summaries on the exact metric, and per-arm lists of them over seeds.

A run is read from ``<out>/<arm>-s<seed>`` when it finished (``done``) or failed twice (``failed``).
A run not under ``--out`` is read from the grid's archive, ``<report dir>/<grid>.runs.json``: the
rows of :data:`KEEP` of every run, rewritten (runs under ``--out`` replacing their archived copies)
whenever the report is generated. That is how the pilot's numbers reach the report of a machine that
never ran the pilot.

The summaries (:class:`ExactArm`, one value per seed in seed order) use the mean of the last 20% of
a run's exact evals, as the verdicts do. A failed run (it diverged, or its process died twice) has
learned nothing usable: it counts as J = 0, and the table says how many runs failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_acrl.logging import read_jsonl_metrics
from megatron_acrl.study.grid import Grid, reused_arms
from megatron_acrl.study.stats import smooth

KEEP = (
    "reward/mean",
    "eval/exact_j",
    "eval/exact_j_served",
    "mismatch/k3_kl",
    "mismatch/chi2_token",
    "mismatch/chi2_seq",
    "mismatch/prob_abs_diff",
    "mismatch/log_ratio_min",
    "mismatch/log_ratio_max",
    "grad_norm",
    "loss/entropy",
    "acrl/y_over_x",
    "acrl/x",
    "correction/weight_max",
    "update_successful",
    "time/step",
    # issue #34's lag sweep: the step controller's scale, the largest PPO ratio
    "step_control/scale",
    "loss/ratio_max",
)
"""The metrics a run's archived rows keep (what the exact report reads)."""

MARKER_KEYS = ("wall_s", "trainer_cpu_s", "server_cpu_s", "rc", "log_tail", "stopped_at_step", "note")


@dataclass
class RunRecord:
    """One run of an exact grid: its rows (``KEEP`` keys + ``step``), and how it ended."""

    arm: str
    seed: int
    rows: list[dict[str, Any]]
    failed: bool = False
    marker: dict[str, Any] = field(default_factory=dict)
    """``done`` / ``failed`` marker fields of :data:`MARKER_KEYS` (wall and CPU seconds, exit code)."""


def _reduce(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"step": int(row["step"])}
    for k in KEEP:
        v = row.get(k)
        if isinstance(v, int | float):
            out[k] = float(f"{float(v):.6g}") if math.isfinite(float(v)) else None
    return out


def _read_run(run_dir: Path, arm: str, seed: int) -> RunRecord | None:
    for name, failed in (("done", False), ("failed", True)):
        marker = run_dir / name
        if marker.exists():
            info: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError):
                info = {k: v for k, v in json.loads(marker.read_text()).items() if k in MARKER_KEYS}
            rows = (
                read_jsonl_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
            )
            return RunRecord(arm, seed, [_reduce(r) for r in rows], failed, info)
    return None


def archive_path(grid: Grid, report_dir: Path) -> Path:
    return report_dir / f"{grid.name}.runs.json"


ARCHIVE_HOME = Path("docs/study")
"""Where the study's archives are committed: a ``reuse`` grid's archive is read from the report
directory, else from here (a pilot reports elsewhere, and still reuses the committed runs)."""


def reused_runs(grid: Grid, report_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The archived runs of ``grid.reuse``'s arms that ``grid`` shares (same settings, checked when the
    grid loaded), by arm; empty without a ``reuse`` grid or its archive."""
    if not grid.reuse:
        return {}
    name = f"{Path(grid.reuse).stem}.runs.json"
    path = next((p for p in (report_dir / name, ARCHIVE_HOME / name) if p.exists()), None)
    if path is None:
        return {}
    runs = json.loads(path.read_text())["runs"]
    return {arm: list(runs[arm]) for arm in reused_arms(grid) if arm in runs}


def without_reused(grid: Grid, report_dir: Path) -> Grid:
    """``grid`` less the runs its ``reuse`` grid's archive already holds finished (they are not run
    again; a failed one is, as the study reruns a failed run)."""
    reused = reused_runs(grid, report_dir)
    if not reused:
        return grid
    arm_seeds, arms = dict(grid.arm_seeds), dict(grid.arms)
    for arm, rs in reused.items():
        have = {int(r["seed"]) for r in rs if not r.get("failed")}
        left = tuple(s for s in grid.seeds_of(arm) if s not in have)
        if left:
            arm_seeds[arm] = left
        else:
            arms.pop(arm)
            arm_seeds.pop(arm, None)
    return dataclasses.replace(grid, arms=arms, arm_seeds=arm_seeds)


def load_runs(grid: Grid, out: Path, report_dir: Path) -> dict[str, list[RunRecord]]:
    """Every run of ``grid`` by arm, in seed order: from ``out`` where it is there, else from the
    grid's archive; the archive is rewritten with the union (a run under ``out`` replaces its archived
    copy, an archived run missing from ``out`` is kept), so no finished run is lost."""
    archive = archive_path(grid, report_dir)
    kept = reused_runs(grid, report_dir)  # the reused grid's runs of shared arms, overridden by ours
    if archive.exists():
        kept.update(json.loads(archive.read_text())["runs"])
    runs: dict[str, list[RunRecord]] = {}
    for arm in grid.arms:
        old = {int(r["seed"]): r for r in kept.get(arm, [])}
        runs[arm] = []
        for s in grid.seeds_of(arm):
            r = _read_run(out / f"{arm}-s{s}", arm, s)
            if r is None and s in old:
                r = RunRecord(**old[s])
            if r is not None:
                runs[arm].append(r)
    if any(runs.values()):
        archive.parent.mkdir(parents=True, exist_ok=True)
        data = {arm: [vars(r) for r in rs] for arm, rs in runs.items()}
        archive.write_text(json.dumps({"grid": grid.name, "runs": data}, separators=(",", ":")) + "\n")
    return runs


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of ``key`` where it was logged with a finite value."""
    return [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), int | float)]


def tail_mean(values: list[float], fraction: float = 0.2) -> float:
    """Mean of the last ``fraction`` of ``values`` (at least one); nan for none."""
    if not values:
        return math.nan
    return statistics.mean(values[-max(1, int(len(values) * fraction)) :])


def head_mean(values: list[float], fraction: float = 0.2) -> float:
    """Mean of the first ``fraction`` of ``values`` (at least one); nan for none."""
    if not values:
        return math.nan
    return statistics.mean(values[: max(1, int(len(values) * fraction))])


def _gap(rows: list[dict[str, Any]], first: bool) -> float:
    both = [r for r in rows if isinstance(r.get("eval/exact_j"), float | int)]
    both = [r for r in both if isinstance(r.get("eval/exact_j_served"), float | int)]
    if not both:
        return math.nan
    r = both[0] if first else both[-1]
    return float(r["eval/exact_j_served"]) - float(r["eval/exact_j"])


def _max(rows: list[dict[str, Any]], key: str) -> float:
    xs = [v for _, v in series(rows, key)]
    return max(xs) if xs else math.nan


def nonfinite_steps(rows: list[dict[str, Any]]) -> int:
    """Steps that logged a non-finite value (archived as null) or a skipped optimizer update."""
    return sum(any(r.get(k, 0.0) is None for k in KEEP) or r.get("update_successful") == 0.0 for r in rows)


@dataclass
class ExactArm:
    """One arm's per-seed summaries (seed order), for the table and the paired verdicts."""

    arm: str
    seeds: list[int]
    failed: list[bool]
    j_trainer: list[float]
    """Mean of the last 20% of the run's ``eval/exact_j`` (0 for a failed run)."""
    j_served: list[float]
    """The same of ``eval/exact_j_served``."""
    j0: list[float]
    """``eval/exact_j`` at the first eval (step 0: the warm start)."""
    gap_start: list[float]
    """Served minus trainer exact J at the first eval (the weights that sample step 1)."""
    gap_end: list[float]
    """The same at the last eval."""
    reward: list[float]
    """Mean sampled training reward over the last 20% of steps."""
    k3_start: list[float]
    """Mean k3 over the first 20% of steps."""
    k3_end: list[float]
    """Mean k3 over the last 20% of steps."""
    weight_max: list[float]
    """Largest correction weight of any step (ACRL's largest weight)."""
    yx_max: list[float]
    """Largest ACRL Y / X of any step."""
    nonfinite: list[int]
    cpu_per_step: list[float]
    """(trainer + server) CPU seconds per RL step, from the ``done`` marker (nan if not recorded)."""
    wall_per_step: list[float]
    """Median ``time/step`` (wall seconds, under whatever load there was)."""
    rows: list[list[dict[str, Any]]] = field(default_factory=list, repr=False)
    k3_peak: list[float] = field(default_factory=list)
    """Largest 5-step mean of k3 (a mismatch that grew and then fell with a collapse shows here)."""
    stopped_at: list[int] = field(default_factory=list)
    """The step a run that was cut short (``stopped_at_step`` in its ``done`` marker) stopped at; 0 for a
    run that ran to its end."""


def summarize_arm(arm: str, runs: list[RunRecord]) -> ExactArm:
    """Per-seed summaries of one arm's runs (see :class:`ExactArm`)."""
    vals: dict[str, list] = {k: [] for k in ExactArm.__dataclass_fields__ if k not in ("arm", "rows")}
    for r in runs:
        jt = [v for _, v in series(r.rows, "eval/exact_j")]
        js = [v for _, v in series(r.rows, "eval/exact_j_served")]
        k3 = [v for _, v in series(r.rows, "mismatch/k3_kl")]
        steps = len([x for x in r.rows if isinstance(x.get("reward/mean"), float | int)])
        cpu = float(r.marker.get("trainer_cpu_s", math.nan)) + float(r.marker.get("server_cpu_s", math.nan))
        times = [v for _, v in series(r.rows, "time/step")]
        vals["seeds"].append(r.seed)
        vals["failed"].append(r.failed)
        vals["j_trainer"].append(0.0 if r.failed else tail_mean(jt))
        vals["j_served"].append(0.0 if r.failed else tail_mean(js))
        vals["j0"].append(jt[0] if jt else math.nan)
        vals["gap_start"].append(_gap(r.rows, True))
        vals["gap_end"].append(math.nan if r.failed else _gap(r.rows, False))
        vals["reward"].append(0.0 if r.failed else tail_mean([v for _, v in series(r.rows, "reward/mean")]))
        vals["k3_start"].append(head_mean(k3))
        vals["k3_end"].append(tail_mean(k3))
        vals["weight_max"].append(_max(r.rows, "correction/weight_max"))
        vals["yx_max"].append(_max(r.rows, "acrl/y_over_x"))
        vals["nonfinite"].append(nonfinite_steps(r.rows))
        vals["cpu_per_step"].append(cpu / steps if steps and not r.failed else math.nan)
        vals["wall_per_step"].append(statistics.median(times) if times else math.nan)
        vals["k3_peak"].append(max(smooth(k3)) if k3 else math.nan)
        vals["stopped_at"].append(int(r.marker.get("stopped_at_step") or 0))
    return ExactArm(arm=arm, rows=[r.rows for r in runs], **vals)


def collect_exact(grid: Grid, out: Path, report_dir: Path) -> list[ExactArm]:
    """:class:`ExactArm` of every arm of ``grid`` with at least one run (from runs or the archive)."""
    runs = load_runs(grid, out, report_dir)
    return [summarize_arm(arm, rs) for arm, rs in runs.items() if rs]
