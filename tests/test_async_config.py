"""Asynchronous RL and the weight lag without servers: integer versions, what the servers serve,
which checkpoints a lag can resume from, and every bad input refused before anything starts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from megatron_acrl.batch.staleness import format_version, parse_version, token_versions
from megatron_acrl.config import ConfigError, load_config
from megatron_acrl.rollout.engine import GenerationEngine
from megatron_acrl.run.resume import DriverState, check_resume
from megatron_acrl.servers.publisher import INDEX_FILE, check_resumable, served_version

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "tiny_dense.yaml")


def error_of(fn, *a, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*a, **kw)
    return str(info.value)


def test_versions_are_integers_parsed_in_one_place():
    assert format_version(3) == "step-3" and parse_version("step-3") == 3
    for bad in ("default", "step-3+unquantized", "v3", ""):
        with pytest.raises(ValueError, match="not of the form step-<int>"):
            parse_version(bad)
    with pytest.raises(ValueError):
        format_version(-1)
    assert DriverState(weight_version="step-7").weight_version == 7  # a checkpoint before integers


def test_token_versions_from_segments():
    assert token_versions(3, "step-2") == [2, 2, 2]
    segs = [{"version": "step-1", "start": 0, "end": 2}, {"version": "step-2", "start": 2, "end": 5}]
    assert token_versions(5, "step-2", segs) == [1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="cover 5 tokens"):
        token_versions(6, "step-2", segs)
    with pytest.raises(ValueError, match="in order"):
        token_versions(5, "step-2", segs[::-1])


def test_served_version_lags_by_whole_steps():
    assert [served_version(v, 2) for v in range(5)] == [0, 0, 0, 1, 2]
    assert [served_version(v, 0) for v in range(3)] == [0, 1, 2]


def _checkpoint(tmp: Path, step: int, versions: list[int] | None) -> Path:
    root = tmp / "ck"
    step_dir = root / f"step_{step:08d}"
    step_dir.mkdir(parents=True)
    (root / "latest.json").write_text(json.dumps({"step": step, "dir": step_dir.name}))
    if versions is not None:
        (step_dir / INDEX_FILE).write_text(json.dumps({"lag": step - min(versions), "versions": versions}))
    return root


def test_a_lagged_checkpoint_is_judged_in_rl_versions_not_optimizer_steps(tmp_path):
    """Issue #36: RL step 6 of a run with 4 optimizer steps per RL step is written as step_00000024;
    its lag-2 sets hold versions [4, 5, 6], which every lag up to 2 can resume from."""
    root = _checkpoint(tmp_path, 24, [4, 5, 6])
    step_dir = root / "step_00000024"
    torch.save({"driver": {"step": 6, "weight_version": 6}}, step_dir / "driver.pt")
    for lag in (0, 1, 2):
        check_resume(
            load_config(CONFIG, [f"training.checkpoint_dir={root}", f"rollout.weight_lag_steps={lag}"])
        )
    longer = load_config(CONFIG, [f"training.checkpoint_dir={root}", "rollout.weight_lag_steps=3"])
    msg = error_of(check_resume, longer)
    assert "serves version 3 at step 6" in msg and "keeps only versions [4, 5, 6]" in msg and "<= 2" in msg


def test_a_lag_the_checkpoint_cannot_serve_is_refused_up_front(tmp_path):
    root = _checkpoint(tmp_path, 5, [3, 4, 5])  # written with weight_lag_steps=2
    ok = load_config(CONFIG, [f"training.checkpoint_dir={root}", "rollout.weight_lag_steps=1"])
    check_resume(ok)  # a smaller lag is served from the stored sets
    longer = load_config(CONFIG, [f"training.checkpoint_dir={root}", "rollout.weight_lag_steps=3"])
    msg = error_of(check_resume, longer)
    assert "rollout.weight_lag_steps" in msg and "keeps only versions [3, 4, 5]" in msg and "<= 2" in msg
    fresh = load_config(CONFIG, [f"training.checkpoint_dir={root}", "training.resume=false"])
    assert "training.resume" in error_of(check_resume, fresh)  # a fresh run would overwrite them
    plain = _checkpoint(tmp_path / "plain", 4, None)  # a run without lag keeps only its own weights
    msg = error_of(
        check_resumable,
        load_config(CONFIG, [f"training.checkpoint_dir={plain}", "rollout.weight_lag_steps=1"]),
        plain / "step_00000004",
        4,
    )
    assert "keeps only versions [4]" in msg


def test_negative_lag_is_refused():
    msg = error_of(load_config, CONFIG, ["rollout.weight_lag_steps=-1"])
    assert "rollout.weight_lag_steps" in msg and ">= 0" in msg


@pytest.mark.parametrize(
    "overrides,key,words",
    [
        (["rollout.mode=async", "rollout.max_staleness=0"], "rollout.max_staleness", ">= 1"),
        (["rollout.mode=async", "rollout.backend=replay"], "rollout.mode", "set rollout.mode=sync"),
        (["rollout.mode=async", "rollout.pause_mode=abort"], "rollout.pause_mode", "partial_rollouts=false"),
        (
            ["rollout.mode=async", "rollout.weight_lag_steps=2", "rollout.max_staleness=1"],
            "rollout.max_staleness",
            "raise it to >= 2",
        ),
        (["rollout.mode=overlap"], "rollout.mode", "async"),
        (["rollout.stale_policy=skip"], "rollout.stale_policy", "drop"),
        (["rollout.producer_cpus=[1]"], "rollout.producer_cpus", "set rollout.mode=async"),
        (["rollout.mode=async", "rollout.producer_cpus=[1,1]"], "rollout.producer_cpus", "distinct"),
        (["rollout.mode=async", "rollout.producer_cpus=[-1]"], "rollout.producer_cpus", ">= 0"),
    ],
)
def test_bad_async_input_names_the_field(overrides, key, words):
    msg = error_of(load_config, CONFIG, overrides)
    assert key in msg and words in msg


def test_good_async_settings_load():
    for extra in (
        ["rollout.pause_mode=in_place"],
        ["rollout.pause_mode=abort", "rollout.partial_rollouts=false"],
        ["rollout.partial_rollouts=false"],
        ["rollout.weight_lag_steps=1", "rollout.max_staleness=2", "rollout.stale_policy=drop"],
    ):
        cfg = load_config(CONFIG, ["rollout.mode=async", *extra])
        assert cfg.rollout.mode == "async"
    # sync mode ignores the async fields (a lag beyond K is fine there: K bounds the producer only)
    assert load_config(CONFIG, ["rollout.weight_lag_steps=3"]).rollout.max_staleness == 1


def test_entry_point_refuses_async_replay_and_async_checkpoints_in_sync(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "megatron_acrl.train", "--config", CONFIG, "rollout.mode=async"]
        + ["--load-rollouts", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2 and "rollout.mode" in res.stderr and "--load-rollouts" in res.stderr
    root = _checkpoint(tmp_path, 3, None)
    pending = {"next_gid": 12, "pending": [[9, "1+1=", "2", 7]]}
    torch.save({"driver": {"step": 3, "producer": pending}}, root / "step_00000003" / "driver.pt")
    sync = load_config(CONFIG, [f"training.checkpoint_dir={root}"])
    msg = error_of(check_resume, sync)
    assert "rollout.mode" in msg and "1 admitted, untrained" in msg
    check_resume(load_config(CONFIG, [f"training.checkpoint_dir={root}", "rollout.mode=async"]))


def _engine_thread_only(overrides: list[str]) -> GenerationEngine:
    """A generation engine with just what starting its thread needs (no servers, no queue)."""
    engine = GenerationEngine.__new__(GenerationEngine)
    engine.cfg = load_config(CONFIG, ["rollout.mode=async", *overrides])
    engine._pinned, engine._pin_error = threading.Event(), None
    engine._loop = asyncio.new_event_loop()
    return engine


def test_producer_thread_runs_on_its_cores_and_leaves_the_trainers():
    cpus = sorted(os.sched_getaffinity(0))
    engine = _engine_thread_only([f"rollout.producer_cpus=[{cpus[-1]}]"])
    seen: dict = {}

    def body() -> None:
        seen["pinned"], seen["cpus"] = engine._pin(), os.sched_getaffinity(0)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"pinned": True, "cpus": {cpus[-1]}}
    assert sorted(os.sched_getaffinity(0)) == cpus  # the trainer's thread keeps its cores
    engine._loop.close()


def test_producer_cores_it_cannot_run_on_are_a_config_error_at_start():
    engine = _engine_thread_only(["rollout.producer_cpus=[100000]"])
    engine._thread = threading.Thread(target=engine._run)
    msg = error_of(engine.start)
    assert "rollout.producer_cpus" in msg and "[100000]" in msg and "[] for the trainer's cores" in msg
    assert not engine._thread.is_alive() and engine._loop.is_closed()
