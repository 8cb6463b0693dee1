"""The study runner: grids validate, summaries and verdicts say what the numbers say, and a smoke grid
through the real loop (shared SGLang server, stress quantization) produces the report and its plots."""

from __future__ import annotations

import json
import shutil
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


def test_stress_lag_grid_is_the_issue_grid_and_its_pilot_the_pilot():
    """The shipped exact grid (issue #23): its five roles, 6 seeds x 150 steps, the pilot on other seeds
    with the pilot's four roles, and the same settings but the steps (so the pilot's go / no-go speaks
    for the grid); the paper's ACRL arm is the paper's law, the extension arm something else."""
    grid = load_grid(ROOT / "configs" / "study" / "stress_lag.yaml")
    pilot = load_grid(ROOT / grid.pilot)
    assert grid.kind == pilot.kind == "exact"
    assert set(grid.roles) == {"bf16", "none", "tis", "acrl", "acrl_ext"}
    assert set(pilot.roles) == {"bf16", "bf16_lag", "none", "tis"}
    assert len(grid.seeds) == 6 and not set(grid.seeds) & set(pilot.seeds) and len(pilot.seeds) == 2
    cfg = {role: grid.configs[arm] for role, arm in grid.roles.items()}
    pcfg = {role: pilot.configs[arm] for role, arm in pilot.roles.items()}
    assert all(c.training.num_steps == 150 for c in cfg.values())
    assert all(c.training.num_steps == 100 for c in pcfg.values())
    for role in ("bf16", "none", "tis"):  # the same run but its length and seed
        a, b = cfg[role], pcfg[role]
        assert (a.rollout, a.correction, a.algorithm) == (b.rollout, b.correction, b.algorithm)
        assert a.model == b.model
        assert a.training.lr == b.training.lr
        assert a.training.exact_eval_interval == b.training.exact_eval_interval
    assert cfg["bf16"].rollout.weight_lag_steps == 0 and cfg["bf16"].rollout.quantization == "none"
    for role in ("none", "tis", "acrl", "acrl_ext"):
        r = cfg[role].rollout
        assert r.stress_quantization and r.fp8_quantize_lm_head and r.weight_lag_steps >= 8
        assert r.kv_cache_dtype == "fp8_e4m3"
    paper, ext = cfg["acrl"].correction, cfg["acrl_ext"].correction
    assert (paper.method, paper.gamma, paper.reference, paper.alpha_max, paper.weight_high) == (
        "acrl",
        0.65,
        "static",
        None,
        None,
    )
    assert ext.method == "acrl" and ext != paper
    assert "(written after the pilot)" not in grid.choices and grid.choices


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


# -- exact grids (issue #23): verdicts on the exact metric, from runs or from the archive ------------

EXACT_ARMS = {
    "b": "[rollout.quantization=none, correction.method=none]",
    "n": "[correction.method=none, rollout.weight_lag_steps=2]",
    "t": "[correction.method=tis, rollout.weight_lag_steps=2]",
    "a": "[correction.method=acrl, rollout.weight_lag_steps=2]",
    "e": "[correction.method=acrl, correction.alpha_max=2.0, rollout.weight_lag_steps=2]",
}
# Final exact J of each arm per seed (1, 2, 3); the served copy scores 0.05 lower under the stress.
FINAL_J = {
    "b": [0.80, 0.70, 0.75],
    "n": [0.60, 0.55, 0.62],
    "t": [0.70, 0.66, 0.70],
    "a": [0.72, 0.64, 0.73],
    "e": [0.71, 0.65, 0.72],
}


def _exact_grid_file(tmp_path: Path, name: str, arms: dict[str, str], roles: str, pilot: str = "") -> Path:
    body = "".join(f"  {arm}: {ov}\n" for arm, ov in arms.items())
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"base: {ROOT / 'configs/tiny_dense.yaml'}\nkind: exact\ntitle: {name}\n"
        "common: [task.num_digits=1, training.exact_eval_interval=5, training.num_steps=20]\n"
        f"seeds: [1, 2, 3]\nroles: {roles}\n" + (f"pilot: {pilot}\n" if pilot else "") + f"arms:\n{body}"
    )
    return path


def _fake_run(out: Path, arm: str, seed: int, final: float, failed_at: int | None = None) -> None:
    """A run's metrics.jsonl and marker: J rises linearly 0.3 -> final over 20 steps, evals every 5."""
    run = out / f"{arm}-s{seed}"
    run.mkdir(parents=True)
    gap = 0.0 if arm == "b" else -0.05
    rows = []
    for step in range(0, 21 if failed_at is None else failed_at + 1):
        row: dict = {"step": step}
        if step:
            row.update(
                {"reward/mean": 0.5, "mismatch/k3_kl": 0.01 * step, "grad_norm": 1.0, "time/step": 2.0}
            )
            row["correction/weight_max"] = 1e3 if arm == "a" else 2.0
            row.update({"mismatch/prob_abs_diff": 0.01 * step, "mismatch/log_ratio_min": -1.0})
            row["mismatch/log_ratio_max"] = 0.5
        if step % 5 == 0:
            j = 0.3 + (final - 0.3) * step / 20
            row.update({"eval/exact_j": j, "eval/exact_j_served": j + gap})
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    marker = {"wall_s": 40.0, "trainer_cpu_s": 30.0, "server_cpu_s": 10.0}
    (run / ("done" if failed_at is None else "failed")).write_text(json.dumps(marker))


def test_exact_grid_checks_its_roles(tmp_path):
    with pytest.raises(ConfigError, match=r"roles\.tis.*names no arm"):
        load_grid(_exact_grid_file(tmp_path, "g", {"b": EXACT_ARMS["b"]}, "{bf16: b, tis: x}"))
    with pytest.raises(ConfigError, match=r"roles.*needs the bf16 role"):
        load_grid(_exact_grid_file(tmp_path, "g", {"b": EXACT_ARMS["b"]}, "{none: b}"))
    with pytest.raises(ConfigError, match=r"arms\.b\.training\.exact_eval_interval.*> 0"):
        load_grid(_exact_grid_file(tmp_path, "g", {"b": "[training.exact_eval_interval=0]"}, "{bf16: b}"))
    with pytest.raises(ConfigError, match=r"roles\.best.*unknown role"):
        load_grid(_exact_grid_file(tmp_path, "g", {"b": EXACT_ARMS["b"]}, "{bf16: b, best: b}"))


def test_seed_shards_split_a_lone_grid_for_the_jobs(tmp_path):
    from megatron_acrl.study.run import seed_shards

    grid = load_grid(_exact_grid_file(tmp_path, "g", {"b": EXACT_ARMS["b"]}, "{bf16: b}"))
    units = seed_shards([[grid]], 2)
    assert [([g.seeds for g in grp], tag) for grp, tag in units] == [
        ([(1, 3)], "_shard0"),
        ([(2,)], "_shard1"),
    ]
    assert seed_shards([[grid], [grid]], 2) == [([grid], ""), ([grid], "")]  # one unit per group


def test_exact_report_from_synthetic_runs_then_from_the_archive(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["study"])
    out, report_dir = tmp_path / "runs", tmp_path / "report"
    pilot = _exact_grid_file(
        tmp_path, "pilot", {"pb": EXACT_ARMS["b"], "pn": EXACT_ARMS["n"]}, "{bf16: pb, none: pn}"
    )
    for seed in (1, 2):  # the pilot: 0.15 below BF16 on average, k3 rising
        _fake_run(out, "pb", seed, 0.75)
        _fake_run(out, "pn", seed, 0.60)
    assert main([str(pilot), "--out", str(out), "--report", str(report_dir), "--report-only"]) == 0
    assert (report_dir / "pilot.runs.json").exists()
    for arm in ("pb", "pn"):  # the pilot's runs are gone: the grid's report reads its archive
        shutil.rmtree(out / f"{arm}-s1"), shutil.rmtree(out / f"{arm}-s2")
    roles = "{bf16: b, none: n, tis: t, acrl: a, acrl_ext: e}"
    grid = _exact_grid_file(tmp_path, "grid", EXACT_ARMS, roles, pilot=str(pilot))
    for arm, finals in FINAL_J.items():
        for seed, final in zip((1, 2, 3), finals, strict=True):
            _fake_run(out, arm, seed, final, failed_at=12 if (arm, seed) == ("e", 3) else None)
    assert main([str(grid), "--out", str(out), "--report", str(report_dir), "--report-only"]) == 0
    report = (report_dir / "REPORT.md").read_text()
    # 1: n - b = -0.20, -0.15, -0.13: mean -0.160, t(2) half-width 4.303 * 0.03606 / sqrt(3) = 0.0896
    assert "1. **The stress is real** (uncorrected vs BF16, trainer's exact J): **yes**" in report
    assert "`n` 0.590 vs `b` 0.750: difference -0.160, 95% CI -0.250 to -0.070; `n` higher on 0/3" in report
    assert "ACRL beats uncorrected** (trainer's exact J):\n   - `a`: **yes**" in report
    assert "`a` 0.697 vs `t` 0.687: difference +0.010" in report and "`a`: **unresolved**" in report
    assert "ACRL is non-inferior to BF16 sync** (served exact J, margin 0.05):\n   - `a`: **no**" in report
    # the failed run counts as J = 0, and the extension verdict names it and the paper arm's weights
    assert "| e | acrl_ext | 3 |" in report and "| 1/3 |" in report
    assert "5. **Our extension reaches the paper's arm without its failures**" in report
    assert "`e`: 1 failed run(s)" in report and "largest weight 1e+03" in report
    # the served-minus-trainer gap at step 1 and at the end, and the cost per step
    assert "| a | acrl | 3 | 0.697 +- 0.049 | 0.647 +- 0.049 | -0.050 +- 0.000 | -0.050 +- 0.000 |" in report
    assert "CPU per RL step (trainer + server processes, all cores): median 2.00 s" in report
    # the pilot, from its archive, with its go / no-go
    assert "### The pilot: pilot" in report and "Go / no-go: **go**" in report
    # the grid's quiet-machine estimate: 5 arms x 3 seeds x 20 steps x 2.0 CPU s / 2 cores = 5 min
    assert "Grid estimate: 15 runs, 0.17 CPU hours" in report and "**about 5 min**" in report
    # ACRL replayed on the uncorrected pilot: static X = Y_1 = 0.01, Y_20 = 0.2, |alpha| = 0.65 * 19
    assert "- `a` on `pn` seed 1: max Y/X 20, max |alpha| 12.3 (18/20 steps above 1)" in report
    assert (
        "- `e` on `pn` seed 2: max Y/X 20, max |alpha| 2 (18/20 steps above 1), largest weight up to 1e0.9"
        in report
    )
    assert (report_dir / "grid_eval_exact_j.png").stat().st_size > 1000
    assert "![grid_eval_exact_j](grid_eval_exact_j.png)" in report
    assert "## The first study (issue #7)" in report and "Carried over unchanged" in report
    # one run gone: it comes from the archive, the others from their runs; then all of them gone
    shutil.rmtree(out / "b-s1")
    assert main([str(grid), "--out", str(out), "--report", str(report_dir), "--report-only"]) == 0
    assert (report_dir / "REPORT.md").read_text().split("### Verdicts")[1] == report.split("### Verdicts")[1]
    shutil.rmtree(out)
    assert main([str(grid), "--out", str(out), "--report", str(report_dir), "--report-only"]) == 0
    again = (report_dir / "REPORT.md").read_text()
    assert again.split("### Verdicts")[1] == report.split("### Verdicts")[1]


def test_exact_verdicts_state_each_outcome():
    from megatron_acrl.study import verdicts
    from megatron_acrl.study.exact import ExactArm

    def arm(name: str, j: list[float]) -> ExactArm:
        n = len(j)
        nan = [float("nan")] * n
        return ExactArm(name, list(range(1, n + 1)), [False] * n, j, j, nan, nan, nan, j, nan, nan, nan, nan,
                        [0] * n, nan, nan)  # fmt: skip

    base = arm("b", [0.70, 0.72, 0.74])
    assert verdicts.stress_is_real(base, arm("n", [0.68, 0.70, 0.72]))[1].startswith(
        "**no**: uncorrected is below BF16 (interval excludes 0) but by 0.020 < 0.05"
    )
    assert verdicts.versus_tis(arm("a", [0.71, 0.73, 0.75]), base)[0] == "superior"
    assert verdicts.versus_tis(arm("a", [0.69, 0.73, 0.74]), base)[0] == "equivalent"
    assert verdicts.versus_tis(arm("a", [0.50, 0.73, 0.90]), base)[0] == "unresolved"
    assert verdicts.versus_tis(arm("a", [0.60, 0.61, 0.65]), base)[0] == "inferior"
    assert verdicts.noninferior(arm("a", [0.69, 0.70, 0.72]), base)[0]
    assert "one common seed" in verdicts.beats(arm("a", [0.9]), arm("n", [0.1]))[1]


def test_verdicts_name_the_missing_arm():
    """With TIS finished but no ACRL arm, verdicts 2-4 say the ACRL arm is missing (not TIS)."""
    from megatron_acrl.study.exact import ExactArm
    from megatron_acrl.study.exact_report import grid_verdicts

    def arm(name: str, j: list[float]) -> ExactArm:
        nan = [float("nan")] * 2
        return ExactArm(name, [1, 2], [False] * 2, j, j, nan, nan, nan, j, nan, nan, nan, nan,
                        [0] * 2, nan, nan)  # fmt: skip

    grid = load_grid(ROOT / "configs" / "study" / "stress_lag.yaml")
    arms = [arm("sl_bf16", [0.7, 0.6]), arm("sl_none", [0.0, 0.1]), arm("sl_tis", [0.6, 0.7])]
    lines = grid_verdicts(grid, arms)
    assert [line.endswith("no ACRL arm finished a run") for line in lines[1:]] == [True, True, True]


def test_pilot_check_reads_a_collapse_on_the_k3_peak():
    """A collapsed uncorrected pilot: k3 rose 1e-2 -> 1 and fell to 1e-3 with the dead policy; the strict
    clause says not rising, the peak reading goes; a peak of only 5x does not."""
    import dataclasses

    from megatron_acrl.study import verdicts
    from megatron_acrl.study.exact import ExactArm

    def arm(name: str, j: list[float], k3: tuple[float, float, float] | None = None) -> ExactArm:
        nan = [float("nan")] * 2
        start, end, peak = k3 or (float("nan"),) * 3
        return ExactArm(name, [101, 102], [False] * 2, j, j, [0.4, 0.5], nan, nan, j, [start] * 2, [end] * 2,
                        nan, nan, [0, 0], nan, nan, k3_peak=[peak] * 2)  # fmt: skip

    bf16, dead = arm("b", [0.75, 0.8]), arm("n", [0.0, 0.0], (1e-2, 1e-3, 1.0))
    go, text = verdicts.pilot_check(bf16, dead)
    assert go and text.startswith("**go**") and "not rising on every seed" in text
    assert "read on k3's peak: at least 10x" in text and "(largest 5-step mean 1, 1)" in text
    weak = dataclasses.replace(dead, k3_peak=[5e-2, 5e-2])
    assert not verdicts.pilot_check(bf16, weak)[0]
    alive = arm("n", [0.6, 0.65], (1e-3, 1e-2, 1.0))  # not collapsed, k3 rising: the strict reading
    go, text = verdicts.pilot_check(bf16, alive)
    assert go and "peak:" not in text


def test_acrl_replay_follows_the_controller():
    """Y = 0.1, 0.2, 0.4: the paper's static X = 0.1 gives Y/X 1, 2, 4; an EMA (decay 0.5) reference
    0.1, 0.1, 0.15 gives 1, 2, 2.67; |alpha| = 0.65 |1 - Y/X|, the weight bound exp(|alpha| * 2)."""
    from megatron_acrl.config import CorrectionConfig
    from megatron_acrl.study.replay import replay

    rows = [{"step": 0, "eval/exact_j": 0.3}] + [
        {"mismatch/prob_abs_diff": y, "mismatch/log_ratio_min": -2.0, "mismatch/log_ratio_max": 1.0}
        for y in (0.1, 0.2, 0.4)
    ]
    paper = replay(rows, CorrectionConfig(method="acrl"))
    assert paper.y_over_x == pytest.approx([1.0, 2.0, 4.0])
    assert paper.alpha == pytest.approx([0.0, 0.65, 1.95])
    assert paper.log10_weight[2] == pytest.approx(1.95 * 2 / 2.302585093)
    ema = replay(rows, CorrectionConfig(method="acrl", reference="ema", ema_decay=0.5, weight_high=2.0))
    assert ema.y_over_x == pytest.approx([1.0, 2.0, 0.4 / 0.15])
    assert max(ema.log10_weight) == pytest.approx(0.30103, abs=1e-5)  # capped at weight_high
    assert "max Y/X 4, max |alpha| 1.95 (1/3 steps above 1)" in paper.summary()


def test_the_replay_defers_the_reference_to_the_runs_lag_as_training_does():
    """The first batch of a lagged run is its only lag-0 one: measured into X it would make every
    later Y/X large; the replay, like the trainer, waits for a batch at ``reference_lag``."""
    from megatron_acrl.config import CorrectionConfig
    from megatron_acrl.study.replay import replay

    rows = [
        {"mismatch/prob_abs_diff": y, "mismatch/log_ratio_min": -1.0, "mismatch/log_ratio_max": 1.0,
         "async/staleness_max": lag}
        for y, lag in ((0.01, 0), (0.2, 8), (0.4, 8))
    ]  # fmt: skip
    cfg = CorrectionConfig(method="acrl")
    assert replay(rows, cfg).y_over_x == pytest.approx([1.0, 20.0, 40.0])  # X from the lag-0 batch
    assert replay(rows, cfg, reference_lag=8).y_over_x == pytest.approx([1.0, 1.0, 2.0])
