"""The study runner: a smoke grid through the real loop produces the report and its plots."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_acrl.config import ConfigError
from megatron_acrl.study import load_grid, main, summarize

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_grids_validate():
    for path in sorted((ROOT / "configs" / "study").glob("*.yaml")):
        grid = load_grid(path)
        assert grid.arms and grid.seeds


def test_bad_arm_is_named(tmp_path):
    bad = tmp_path / "g.yaml"
    bad.write_text(f"base: {ROOT / 'configs/tiny_dense.yaml'}\narms:\n  x: [correction.methd=tis]\n")
    with pytest.raises(ConfigError, match=r"arms\.x.*did you mean 'correction.method'"):
        load_grid(bad)


def test_summarize_flags_collapse():
    rise = [{"reward/mean": x / 10} for x in range(10)]
    fall = [{"reward/mean": x} for x in (0.5, 0.6, 0.7, 0.7, 0.7, 0.6, 0.3, 0.1, 0.0, 0.0)]
    assert summarize(rise)["collapsed"] == 0.0 and summarize(rise)["peak"] == pytest.approx(0.9)
    assert summarize(fall)["collapsed"] == 1.0


def test_smoke_grid_writes_report_and_plots(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["study"])
    rc = main(
        [
            str(ROOT / "configs/study/smoke.yaml"),
            "--out",
            str(tmp_path / "runs"),
            "--report",
            str(tmp_path / "report"),
        ]
    )
    assert rc == 0
    report = (tmp_path / "report" / "REPORT.md").read_text()
    assert "| fp8_none |" in report and "| fp8_acrl |" in report
    assert (tmp_path / "report" / "reward_mean.png").stat().st_size > 1000
    assert "![reward_mean](reward_mean.png)" in report
