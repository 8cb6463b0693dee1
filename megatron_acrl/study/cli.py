"""The study's command line: ``python -m megatron_acrl.study GRID.yaml ... [--jobs N] [--report-only]``.

Validates every grid file (and that a shared arm is the same run in each) before anything runs, runs
the grids unless ``--report-only``, records the invocation's wall time in ``<out>/study_wall.json``,
and writes the report. The entry point owns SIGTERM / SIGINT (:mod:`megatron_acrl.world.signals`): the
first stops the study before its next run (the finished runs are kept and reused by the same command),
a second stops it at once; either way the study's SGLang servers are stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path

from megatron_acrl import study
from megatron_acrl.config import ConfigError
from megatron_acrl.config.exit_codes import CONFIG_ERROR
from megatron_acrl.study.exact import without_reused
from megatron_acrl.study.grid import Grid, conflicting_arm, load_grid
from megatron_acrl.study.report import write_report
from megatron_acrl.study.run import StudyStopped, run_grids
from megatron_acrl.world.signals import Interrupted, StopSignals, stop_on_signals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    summary = (study.__doc__ or "").split("\n")[0]
    ap = argparse.ArgumentParser(prog="python -m megatron_acrl.study", description=summary)
    ap.add_argument("grids", nargs="+", help="grid YAML files in configs/study/ (run in turn)")
    ap.add_argument("--out", default="runs/study", help="where the runs go (finished runs are reused)")
    ap.add_argument("--report", default="docs/study", help="where REPORT.md and the plots go")
    ap.add_argument("--report-only", action="store_true", help="write the report from finished runs")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the grid files and list the runs that would start (nothing runs, nothing is written)",
    )
    ap.add_argument("--note", default="", help="a paragraph for the top of the report (how it was run)")
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="run only these of the grids' seeds (several invocations can share --out; the report "
        "covers every finished seed of the grid files)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="grids run concurrently, each with its own server (grids sharing an arm stay together)",
    )
    return ap.parse_args(argv)


def run_study(
    args: argparse.Namespace, grids: list[Grid], stop: StopSignals
) -> tuple[float, list[tuple[str, int]]]:
    """Run the grids (the ``--seeds`` of them) and record the wall time; returns it and the runs
    that failed."""
    out = Path(args.out)
    t0 = time.monotonic()
    todo = [without_reused(g, Path(args.report)) for g in grids]  # archived runs of a `reuse` grid
    if args.seeds:
        todo = [dataclasses.replace(g, seeds=tuple(x for x in g.seeds if x in args.seeds)) for g in todo]
    failed = run_grids([g for g in todo if g.seeds], out, args.jobs, stop)
    wall = time.monotonic() - t0
    (out / "study_wall.json").write_text(
        json.dumps({"wall_s": wall, "grids": [g.name for g in grids], "jobs": args.jobs}) + "\n"
    )
    return wall, failed


def dry_run(args: argparse.Namespace, grids: list[Grid]) -> int:
    """Print each grid's runs (arm, seeds; the ones a ``reuse`` grid's archive holds marked) and
    its pre-registered verdicts; runs nothing."""
    total = 0
    for g in grids:
        left = without_reused(g, Path(args.report))
        print(f"{g.name}: {g.title}")
        for arm in g.arms:
            todo = left.seeds_of(arm) if arm in left.arms else ()
            if args.seeds:
                todo = tuple(s for s in todo if s in args.seeds)
            reused = [s for s in g.seeds_of(arm) if s not in todo]
            total += len(todo)
            note = f" (reused from {g.reuse}: seeds {reused})" if reused and g.reuse else ""
            print(f"  {arm}: seeds {list(todo)}{note}")
        for i, v in enumerate(g.verdicts, 1):
            print(f"  verdict {i}: {' '.join(v.split())}")
    print(f"dry run: {total} run(s) would start")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        grids = [load_grid(p) for p in args.grids]
    except ConfigError as err:
        print(err, file=sys.stderr)
        return CONFIG_ERROR
    arm = conflicting_arm(grids)
    if arm is not None:
        print(f"arm {arm!r} appears in several grids with different settings; rename one", file=sys.stderr)
        return CONFIG_ERROR
    if args.dry_run:
        return dry_run(args, grids)
    t0 = time.monotonic()
    try:
        with stop_on_signals() as stop:
            wall, failed = (None, []) if args.report_only else run_study(args, grids, stop)
            spent = time.monotonic() - t0
            report = write_report(grids, Path(args.out), Path(args.report), wall, note=args.note)
    except (StudyStopped, Interrupted) as err:
        print(f"study: {err}; the finished runs in {args.out} are kept for the same command", file=sys.stderr)
        return 128 + (stop.signum or signal.SIGINT)
    print(f"study report: {report}")
    print(f"study: total wall time {spent / 60:.1f} min", flush=True)
    if failed:
        runs = ", ".join(f"{arm} seed {seed}" for arm, seed in failed)
        print(
            f"study: {len(failed)} run(s) failed twice ({runs}); see <run>/failed and train.log",
            file=sys.stderr,
        )
        return 1
    return 0
