"""The study runner: grids validate, summaries and verdicts say what the numbers say, and a smoke grid
through the real loop (shared SGLang server, stress quantization) produces the report and its plots."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_acrl.config import ConfigError
from megatron_acrl.study.cli import main
from megatron_acrl.study.grid import grid_groups, load_grid
from megatron_acrl.study.report import verdict
from megatron_acrl.study.stats import ArmResult, summarize

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_grids_validate():
    arms: dict[str, tuple] = {}
    for path in sorted((ROOT / "configs" / "study").glob("*.yaml")):
        grid = load_grid(path)
        assert grid.arms and grid.seeds
        for arm, overrides in grid.arms.items():
            # an arm name shared by two grids must be the same run (the shared BF16 baseline)
            spec = (grid.base, grid.common, overrides)
            assert arms.setdefault(arm, spec) == spec, f"{arm} differs between grids"


def test_full_grids_have_the_issue_arms():
    for name in ("dense", "dense_stress", "moe_stress"):
        grid = load_grid(ROOT / "configs" / "study" / f"{name}.yaml")
        methods = sorted(
            (c.rollout.quantization == "none", c.correction.method) for c in grid.configs.values()
        )
        assert (True, "none") in methods
        for m in ("none", "tis", "seq_mis", "icepop", "acrl"):
            assert (False, m) in methods, (name, m)
        assert len(grid.seeds) >= 3
        stressed = [c for c in grid.configs.values() if c.rollout.quantization != "none"]
        assert all(c.rollout.stress_quantization for c in stressed) == grid.stress


def test_bad_arm_is_named(tmp_path):
    bad = tmp_path / "g.yaml"
    bad.write_text(f"base: {ROOT / 'configs/tiny_dense.yaml'}\narms:\n  x: [correction.methd=tis]\n")
    with pytest.raises(ConfigError, match=r"arms\.x.*did you mean 'correction.method'"):
        load_grid(bad)


def test_stress_needs_fp8(tmp_path):
    bad = tmp_path / "g.yaml"
    bad.write_text(
        f"base: {ROOT / 'configs/tiny_dense.yaml'}\n"
        "arms:\n  x: [rollout.quantization=none, rollout.fp8_rounding=toward_zero]\n"
    )
    with pytest.raises(ConfigError, match=r"arms\.x\.rollout\.quantization.*stress"):
        load_grid(bad)


def test_summarize_flags_collapse():
    rise = [{"reward/mean": x / 10} for x in range(10)]
    fall = [{"reward/mean": x} for x in (0.5, 0.6, 0.7, 0.7, 0.7, 0.6, 0.3, 0.1, 0.0, 0.0)]
    assert summarize(rise)["collapsed"] == 0.0 and summarize(rise)["peak"] == pytest.approx(0.9)
    assert summarize(fall)["collapsed"] == 1.0


def _arm(name: str, method: str, quant: str, last20: list[float]) -> ArmResult:
    seeds = list(range(1, len(last20) + 1))
    return ArmResult(name, method, quant, last20, last20, [False] * len(last20), [], [], [], seeds=seeds)


def _baseline_and_acrl_grid(tmp_path: Path, stress: bool):  # noqa: ANN202
    """A grid file with a BF16-rollout arm ``b`` and an ACRL arm ``a``."""
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(
        f"base: {ROOT / 'configs/tiny_dense.yaml'}\nstress: {str(stress).lower()}\n"
        "arms:\n  b: [rollout.quantization=none, correction.method=none]\n  a: [correction.method=acrl]\n"
    )
    return load_grid(grid_file)


def test_verdict_states_the_goal_with_numbers(tmp_path):
    grid = _baseline_and_acrl_grid(tmp_path, stress=True)
    results = [
        _arm("b", "none", "none", [0.5, 0.6, 0.7]),
        _arm("a", "acrl", "fp8_block", [0.6, 0.6, 0.6]),
        _arm("t", "tis", "fp8_block", [0.6, 0.7, 0.8]),
        _arm("m", "seq_mis", "fp8_block", [0.1, 0.2, 0.3]),
    ]
    text = "\n".join(verdict(grid, results))
    assert "ACRL >= BF16 rollout: `a` 0.600 +- 0.000 vs `b` 0.600 +- 0.100: **yes**" in text
    # paired differences 0, -0.1, -0.2: mean -0.1, t(2) = 4.303, half-width 4.303 * 0.1 / sqrt(3)
    assert (
        "ACRL > TIS: `a` 0.600 +- 0.000 vs `t` 0.700 +- 0.100: **no** "
        "(difference -0.100, 95% CI -0.348 to +0.148; > on 0/3"
    ) in text
    assert "ACRL > MIS: `a` 0.600 +- 0.000 vs `m` 0.200 +- 0.100: **yes**" in text
    # seeds are paired: an arm with fewer finished seeds is compared on the common ones only
    short = ArmResult("a", "acrl", "fp8_block", [0.6], [0.6], [False], [], [], [], seeds=[2])
    line = verdict(grid, [results[0], short])[0]
    assert "`a` 0.600 +- 0.000 vs `b` 0.600 +- 0.000: **yes**" in line and "only 1 common seed" in line
    assert "CI" not in line  # no interval from one pair


def test_verdict_on_another_metric(tmp_path):
    """The supplementary verdict (trainer's weights) compares that list, and skips seeds without it."""
    grid = _baseline_and_acrl_grid(tmp_path, stress=False)
    b, a = _arm("b", "none", "none", [0.5, 0.6, 0.7]), _arm("a", "acrl", "fp8_block", [0.1, 0.1, 0.1])
    b.trainer_eval, a.trainer_eval = [0.5, 0.5, 0.5], [0.6, float("nan"), 0.7]
    line = verdict(grid, [b, a], "trainer_eval")[0]
    assert "`a` 0.650 +- 0.071 vs `b` 0.500 +- 0.000: **yes**" in line and "only 2 common seed" in line
    assert "**no**" in verdict(grid, [b, a])[0]  # the goal's metric is unchanged
    assert verdict(
        grid, [_arm("b", "none", "none", [0.5]), _arm("a", "acrl", "fp8_block", [0.5])], "first"
    ) == ["(no arm logged first: no verdict)"]


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
    assert "| smoke_bf16 |" in report and "| smoke_stress_acrl |" in report
    assert "ACRL >= BF16 rollout" in report and "Wall time of the grid invocation" in report
    assert (tmp_path / "report" / "smoke_reward_mean.png").stat().st_size > 1000
    assert "![smoke_reward_mean](smoke_reward_mean.png)" in report
    assert (tmp_path / "report" / "smoke_mismatch_k3_kl.png").exists()
    # the final eval ran on the served and on the trainer's weights, in both arms, and is reported
    assert (tmp_path / "report" / "smoke_eval_trainer_sampled_reward.png").exists()
    assert "## The same comparisons on the trainer's own weights" in report
    for arm in ("smoke_bf16", "smoke_stress_acrl"):
        row = next(x for x in report.splitlines() if x.startswith(f"| {arm} |")).split(" | ")
        served, trainer = float(row[-4]), float(row[-3])  # one seed: plain numbers
        assert 0.0 <= served <= 1.0 and 0.0 <= trainer <= 1.0
    # The FP8-KV arm ran on its own shared server, launched with the KV emulation; the BF16 arm did not.
    assert "round every cached K and V through e4m3" in report

    def hooks(log: str) -> list[str]:
        line = next(x for x in (tmp_path / "runs" / log).read_text().splitlines() if "_CPU_HOOKS=" in x)
        return line.split("=", 1)[1].split(",")

    assert "fp8_kv" not in hooks("sglang_smoke.log")
    assert "fp8_kv" in hooks("sglang_smoke_kv_fp8_e4m3.log")


def test_grids_sharing_an_arm_run_together(tmp_path):
    base = ROOT / "configs/tiny_dense.yaml"
    files = {}
    for name, arms in {"a": ["x", "y"], "b": ["z"], "c": ["y", "w"]}.items():
        body = "".join(f"  {arm}: [correction.method=none]\n" for arm in arms)
        files[name] = tmp_path / f"{name}.yaml"
        files[name].write_text(f"base: {base}\narms:\n{body}")
    groups = grid_groups([load_grid(files[n]) for n in "abc"])
    assert sorted([g.name for g in grp] for grp in groups) == [["a", "c"], ["b"]]
