"""Sync and async runs of one config in the same figures: per step and against training time."""

from __future__ import annotations

import json

from megatron_acrl.plots import plot_runs, series


def test_sync_and_async_curves_share_each_figure(tmp_path):
    runs = []
    for name, step_s, stale in (("sync", 2.0, 0.0), ("async", 1.0, 1.0)):
        run = tmp_path / name
        run.mkdir()
        rows = [
            {
                "step": s,
                "reward/mean": 0.05 * s,
                "time/step": step_s,
                "time/trainer_idle": 0.5 / step_s,
                "async/staleness_mean": stale,
            }
            for s in range(1, 13)
        ]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        runs.append(run)
    names = {f.name for f in plot_runs(runs, tmp_path / "plots")}
    assert {
        "reward_mean.png",
        "reward_mean_vs_time.png",
        "async_staleness_mean.png",
        "time_trainer_idle.png",
    } <= names
    rows = [json.loads(x) for x in (runs[1] / "metrics.jsonl").read_text().splitlines()]
    xs, ys = series(rows, "reward/mean", "time")
    assert xs[:3] == [1.0, 2.0, 3.0] and ys[0] == 0.05  # seconds of training, the step's own included


def test_async_reward_script_draws_both_modes_and_tabulates_them(tmp_path):
    """scripts/async_reward.py --report-only: one figure (reward, exact J) and a row per mode."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "async_reward.py"
    spec = importlib.util.spec_from_file_location("async_reward", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for mode, base in (("sync", 0.30), ("async", 0.32)):
        (tmp_path / mode).mkdir()
        rows = [
            {"step": s, "reward/mean": base + 0.01 * s, "time/step": 1.0}
            | ({"eval/exact_j": base + 0.02 * s} if s % 10 == 0 else {})
            for s in range(1, 21)
        ]
        (tmp_path / mode / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    runs = mod.curves(tmp_path)
    mod.draw(runs, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 0
    lines = mod.table(runs).splitlines()
    assert lines[2].startswith("| sync | 20 | 0.330 | 0.480 | 0.500 -> 0.700 | 1.000 |"), lines
    assert lines[3].startswith("| async | 20 | 0.350 | 0.500 |"), lines
