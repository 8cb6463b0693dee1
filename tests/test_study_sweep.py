"""Issue #34's study grids: the pilot and the lag sweep load, pre-register their verdicts, reuse the
30 lag-8 runs as they are (same settings, not run again), give each lag x method cell its seeds; the
sweep's pick table and its reward-hacking flag on synthetic arms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_acrl.config import ConfigError
from megatron_acrl.study.cli import main
from megatron_acrl.study.exact import ExactArm, without_reused
from megatron_acrl.study.grid import load_grid, reused_arms
from megatron_acrl.study.sweep import arm_kind, cells, pick_table, reward_minus_served, unstable

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "configs" / "study"


def test_the_lag_sweep_has_every_cell_with_its_seeds_and_reuses_the_lag8_runs() -> None:
    grid = load_grid(STUDY / "lag_sweep.yaml")
    old = load_grid(STUDY / "stress_lag.yaml")
    assert set(reused_arms(grid)) == set(old.arms)  # the 30 runs: 5 arms x 6 seeds
    for arm in old.arms:
        assert grid.arms[arm] == old.arms[arm] and grid.seeds_of(arm) == old.seeds
    assert grid.common == old.common and grid.base == old.base
    by = {(c.rollout.weight_lag_steps, arm_kind(c)): a for a, c in grid.configs.items()}
    kinds = ("none", "tis", "acrl_ext", "tis+step", "safe+step")
    for lag in (0, 2, 8):
        for kind in kinds:
            arm = by[(lag, kind)]
            want = 6 if lag == 8 else 3
            assert len(grid.seeds_of(arm)) == want, (lag, kind)
    assert (0, "bf16") in by and (8, "acrl") in by
    safe = grid.configs[by[(8, "safe+step")]].correction
    ext = grid.configs[by[(8, "acrl_ext")]].correction
    # sign-safe ACRL is the extension with alpha_min = 0: the comparison isolates the sign
    assert (safe.alpha_min, safe.step_control) == (0.0, "drift_budget")
    assert (safe.alpha_max, safe.eps, safe.weight_high) == (ext.alpha_max, ext.eps, ext.weight_high)
    assert len(grid.verdicts) >= 6 and grid.pilot
    # the pilots' choices, written before the sweep ran: kappa 1.5, B_min 0.05 on every step arm, and
    # TIS + dual clip at lag 8 on 6 seeds
    for arm, c in grid.configs.items():
        if c.correction.step_control == "drift_budget":
            assert (c.correction.step_kappa, c.correction.step_budget_min) == (1.5, 0.05), arm
    dual = [a for a, c in grid.configs.items() if c.algorithm.dual_clip == 3.0]
    assert [grid.seeds_of(a) for a in dual] == [(1, 2, 3, 4, 5, 6)] and "kappa 1.5" in grid.choices


def test_the_second_pilot_tries_the_tighter_knobs_on_the_pilot_seeds() -> None:
    pilot2 = load_grid(STUDY / "lag_sweep_pilot2.yaml")
    new = [a for a in pilot2.configs if a not in reused_arms(pilot2)]
    assert pilot2.seeds == (101, 102) and len(new) == 2
    for a in new:
        c = pilot2.configs[a].correction
        assert (c.step_control, c.step_kappa, c.step_budget_min) == ("drift_budget", 1.5, 0.05)


def test_the_pilot_has_its_three_arms_on_two_seeds() -> None:
    pilot = load_grid(STUDY / "lag_sweep_pilot.yaml")
    assert pilot.seeds == (101, 102) and all(c.training.num_steps == 100 for c in pilot.configs.values())
    new = {a: arm_kind(c) for a, c in pilot.configs.items() if a not in reused_arms(pilot)}
    lags = {pilot.configs[a].rollout.weight_lag_steps for a in new}
    assert sorted(new.values()) == ["bf16+dual", "bf16+step", "tis+step"] and lags == {8}
    dual = next(a for a, k in new.items() if k == "bf16+dual")
    assert pilot.configs[dual].algorithm.dual_clip == 3.0
    assert len(pilot.verdicts) >= 3


def test_dry_run_lists_the_new_runs_only(capsys) -> None:
    grids = [str(STUDY / "lag_sweep_pilot.yaml"), str(STUDY / "lag_sweep.yaml")]
    assert main([*grids, "--dry-run", "--report", str(ROOT / "docs" / "study")]) == 0
    out = capsys.readouterr().out
    assert "dry run: 54 run(s) would start" in out  # 6 pilot runs + 48 sweep runs
    assert "verdict 1:" in out


def _grid(tmp: Path, name: str, arms: str, extra: str = "") -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(
        f"base: {ROOT / 'configs/tiny_dense.yaml'}\ntitle: {name}\ncommon: [task.num_digits=1]\n"
        f"seeds: [1, 2, 3]\n{extra}arms:\n{arms}"
    )
    return path


def test_reuse_refuses_an_arm_of_the_same_name_and_other_settings(tmp_path: Path) -> None:
    old = _grid(tmp_path, "old", "  a: [correction.method=tis]\n")
    _grid(tmp_path, "ok", "  a: [correction.method=tis]\n  b: [correction.method=none]\n", f"reuse: {old}\n")
    with pytest.raises(ConfigError, match="settings differ"):
        load_grid(_grid(tmp_path, "bad", "  a: [correction.method=none]\n", f"reuse: {old}\n"))
    with pytest.raises(ConfigError, match="no such grid"):
        load_grid(_grid(tmp_path, "gone", "  a: [correction.method=tis]\n", "reuse: nowhere.yaml\n"))
    with pytest.raises(ConfigError, match="names no arm"):
        load_grid(_grid(tmp_path, "seeds", "  a: [correction.method=tis]\n", "arm_seeds: {z: [1]}\n"))


def test_archived_finished_runs_of_a_reused_grid_are_not_run_again(tmp_path: Path) -> None:
    old = _grid(tmp_path, "old", "  a: [correction.method=tis]\n")
    new = load_grid(
        _grid(
            tmp_path, "new", "  a: [correction.method=tis]\n  b: [correction.method=none]\n",
            f"reuse: {old}\narm_seeds: {{b: [1, 2]}}\n",
        )
    )  # fmt: skip
    assert new.seeds_of("b") == (1, 2) and new.seeds_of("a") == (1, 2, 3)
    runs = {"a": [{"arm": "a", "seed": 1, "rows": [], "failed": False, "info": {}},
                  {"arm": "a", "seed": 2, "rows": [], "failed": True, "info": {}}]}  # fmt: skip
    (tmp_path / "old.runs.json").write_text(json.dumps({"grid": "old", "runs": runs}))
    left = without_reused(new, tmp_path)
    assert left.seeds_of("a") == (2, 3)  # seed 1 archived; the failed seed 2 runs again
    assert left.seeds_of("b") == (1, 2)


def _arm(
    name: str, j: list[float], reward: float = 0.5, failed: bool = False, big_grad: bool = False
) -> ExactArm:
    n = len(j)
    rows = [[{"grad_norm": 5e3 if big_grad else 1.0} for _ in range(10)] for _ in range(n)]
    return ExactArm(
        name, list(range(1, n + 1)), [failed] * n, j, [x - 0.1 for x in j], j, [0.0] * n, [0.0] * n,
        [reward] * n, [0.0] * n, [0.0] * n, [1.0] * n, [1.0] * n, [0] * n, [1.0] * n, [1.0] * n, rows,
    )  # fmt: skip


def test_the_pick_table_takes_the_best_not_worse_than_tis_and_ties_to_the_simplest(tmp_path: Path) -> None:
    arms_yaml = (
        "  t: [correction.method=tis, rollout.weight_lag_steps=8]\n"
        "  s: [correction.method=tis, correction.step_control=drift_budget, rollout.weight_lag_steps=8]\n"
        "  n: [correction.method=none, rollout.quantization=fp8_per_tensor, rollout.weight_lag_steps=8]\n"
        "  t2: [correction.method=tis, rollout.weight_lag_steps=2]\n"
        "  s2: [correction.method=tis, correction.step_control=drift_budget, rollout.weight_lag_steps=2]\n"
    )
    grid = load_grid(_grid(tmp_path, "g", arms_yaml))
    assert {k for _, k in cells(grid, [_arm(a, [0.1]) for a in grid.arms])} == {"tis", "tis+step", "none"}
    arms = [
        _arm("t", [0.4, 0.5, 0.45]),
        _arm("s", [0.6, 0.7, 0.65]),
        _arm("n", [0.9, 0.9, 0.9], big_grad=True),  # the best J, but unstable
        _arm("t2", [0.5, 0.5, 0.5]),
        _arm("s2", [0.5, 0.5, 0.5]),  # a tie: the simpler TIS is picked
    ]
    assert unstable(arms[2]) and not unstable(arms[0])
    table = "\n".join(pick_table(grid, arms))
    assert "| 8 | `s` (tis+step) |" in table and "none 0.900 (unstable)" in table
    assert "| 2 | `t2` (tis) |" in table
    flags = reward_minus_served([_arm("t", [0.2, 0.3], reward=0.6)])
    assert flags == ["- `t`: reward - served J = +0.450 (reward 0.600)"]


def test_an_async_run_gets_the_sweeps_pick_and_explain_says_so() -> None:
    from megatron_acrl.config.loader import ASYNC_SOURCE, explain, load_config_with_sources

    cfg, sources = load_config_with_sources(ROOT / "configs" / "tiny_async.yaml")
    assert cfg.rollout.mode == "async" and cfg.correction.method == "acrl"
    assert (cfg.correction.step_control, cfg.correction.alpha_min) == ("drift_budget", 0.0)
    assert sources["correction.step_control"] == sources["correction.alpha_min"] == ASYNC_SOURCE
    assert (cfg.correction.step_kappa, cfg.correction.step_budget_min) == (1.5, 0.05)
    lines = "\n".join(explain(cfg, sources))
    want = f"correction.step_control: 'none' | 'drift_budget' = 'drift_budget'  (from {ASYNC_SOURCE})"
    assert want in lines
    # an async run without a method gets TIS (the pick), with no alpha_min
    cfg, sources = load_config_with_sources(None, ["rollout.mode=async"])
    assert (cfg.correction.method, cfg.correction.step_control, cfg.correction.alpha_min) == (
        "tis",
        "drift_budget",
        None,
    )
    assert sources["correction.method"] == ASYNC_SOURCE
    # an explicit value wins; TIS gets no alpha_min; a sync run (even lagged) is unchanged
    cfg, sources = load_config_with_sources(
        ROOT / "configs" / "tiny_async.yaml", ["correction.step_control=none", "correction.method=tis"]
    )
    assert (cfg.correction.step_control, cfg.correction.alpha_min) == ("none", None) and not sources
    cfg, sources = load_config_with_sources(ROOT / "configs" / "demo.yaml", ["rollout.weight_lag_steps=8"])
    assert (cfg.correction.step_control, cfg.correction.alpha_min) == ("none", None)
    assert not any(k.startswith("correction.") for k in sources)
