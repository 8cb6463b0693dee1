"""W&B offline run and metrics.jsonl are written and read back."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from megatron_acrl.config import LoggingConfig
from megatron_acrl.logging import RunLogger, read_jsonl_metrics, read_wandb_history


def test_offline_run_reads_back(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = RunLogger(LoggingConfig(wandb_mode="offline"), tmp_path / "run", config={"x": 1})
    for step in range(3):
        log.log(
            step,
            {"reward/mean": 0.5 * step, "mismatch/k3_kl": 1e-3, "mismatch/chi2_seq": float("inf")},
            histograms={"mismatch/log_ratio": np.linspace(-1, 1, 50)},
            table=(["prompt", "completion"], [["1+1=", "2"]]),
        )
    log.close()
    hist = read_wandb_history(log.wandb_dir)
    assert [r["reward/mean"] for r in hist] == pytest.approx([0.0, 0.5, 1.0])
    assert hist[0]["mismatch/log_ratio/_type"] == "histogram"
    assert hist[0]["samples/_type"] == "table-file"
    rows = read_jsonl_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[2]["step"] == 2 and rows[2]["mismatch/chi2_seq"] == "inf"
    assert "reward 1" in capsys.readouterr().err


def test_disabled_rank_writes_nothing(tmp_path):
    log = RunLogger(LoggingConfig(), tmp_path / "run", enabled=False)
    log.log(0, {"a": 1.0})
    log.close()
    assert not (tmp_path / "run").exists()


def test_thread_clock_counts_this_threads_cpu_and_its_run_queue_wait():
    import math as _math
    import threading

    from megatron_acrl.logging import thread_clock
    from megatron_acrl.train import phase_metrics

    c0 = thread_clock()
    sum(i * i for i in range(200_000))  # CPU work on this thread
    c1 = thread_clock()
    assert c1[0] > c0[0]
    assert _math.isnan(c1[1]) or c1[1] >= c0[1] >= 0.0
    other: list = []
    t = threading.Thread(target=lambda: other.append(thread_clock()))
    t.start()
    t.join()
    assert other[0][0] < c1[0]  # a new thread's own clock, not the process's
    import torch

    m = phase_metrics({"loss_mask": torch.ones(2, 3)}, (0.0, 1.0, 1.5, 2.5, 3.0), (c0, c1))
    assert m["time/train"] == 1.0 and m["time/train_cpu"] == c1[0] - c0[0]
    assert "time/train_runq" in m and "time/train_cpu" not in phase_metrics(
        {"loss_mask": torch.ones(2, 3)}, (0.0, 1.0, 1.5, 2.5, 3.0)
    )


# -- every step exactly once (issue #25): a resume supersedes what an earlier attempt logged after it ----


def _attempt(tmp_path, steps, resume_step, run_id=None, mode="disabled", value=0.0):
    log = RunLogger(
        LoggingConfig(wandb_mode=mode, console=False),
        tmp_path / "run",
        resume_id=run_id,
        resume_step=resume_step,
    )
    for step in steps:
        log.log(step, {"x": value + step})
    log.close()
    return log


def test_a_resume_supersedes_the_rows_after_its_step_and_keeps_them_aside(tmp_path, capsys):
    from megatron_acrl.logging import SUPERSEDED

    _attempt(tmp_path, [0, 1, 2, 3, 4, 5, 6], 0)  # a fresh run with its step-0 row; checkpoint at 4
    _attempt(tmp_path, [5, 6, 7], 4, value=100.0)  # crashed after 6 logged, resumed from step 4
    assert "2 row(s) logged after step 4 by an earlier attempt" in capsys.readouterr().err
    rows = read_jsonl_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [r["x"] for r in rows[5:]] == [105.0, 106.0, 107.0]  # the checkpoint's own lineage
    aside = read_jsonl_metrics(tmp_path / "run" / SUPERSEDED)
    assert [(r["step"], r["x"], r["superseded_at_resume"]) for r in aside] == [(5, 5.0, 4), (6, 6.0, 4)]


def test_rows_logged_twice_before_the_fix_keep_the_later_one_and_a_fresh_start_keeps_none(tmp_path):
    from megatron_acrl.logging import SUPERSEDED, supersede_rows_after

    path = tmp_path / "metrics.jsonl"
    steps = [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]  # what the issue found: 1..6, 5, 6, 7..
    path.write_text("".join(f'{{"step": {s}, "i": {i}}}\n' for i, s in enumerate(steps)) + "not json\n")
    assert supersede_rows_after(path, 8) == 3
    rows = read_jsonl_metrics(path)
    # each step once, in order, the later of the two rows of steps 5 and 6 (lines 6 and 7)
    assert [(r["step"], r["i"]) for r in rows] == [
        (1, 0),
        (2, 1),
        (3, 2),
        (4, 3),
        (5, 6),
        (6, 7),
        (7, 8),
        (8, 9),
    ]
    aside = (tmp_path / SUPERSEDED).read_text().splitlines()
    assert aside[-1] == "not json" and [json.loads(r)["step"] for r in aside[:-1]] == [5, 6]
    assert supersede_rows_after(path, 8) == 0  # nothing to do: the file is left alone
    assert supersede_rows_after(path, 0) == 8 and read_jsonl_metrics(path) == []  # a fresh start
    assert len((tmp_path / SUPERSEDED).read_text().splitlines()) == 11  # nothing lost


def test_offline_wandb_attempts_read_back_each_step_once(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = _attempt(tmp_path, [1, 2, 3, 4], 0, mode="offline")
    # W&B names an attempt's directory by its start second: a real resume starts tens of seconds
    # later, one in this test could start in the same second and reuse (overwrite) the directory.
    started = int(time.time())
    while int(time.time()) == started:
        time.sleep(0.05)
    _attempt(tmp_path, [3, 4, 5], 2, run_id=first.run_id, mode="offline", value=100.0)
    assert len(list(first.wandb_dir.rglob(f"run-{first.run_id}.wandb"))) == 2  # one file per attempt
    hist = read_wandb_history(first.wandb_dir)
    want = [(1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0), (5, 105.0)]  # attempt 2 supersedes from step 3
    assert [(int(r["_step"]), r["x"]) for r in hist] == want


def test_a_wandb_service_killed_by_the_schedulers_signal_does_not_end_the_run(tmp_path, monkeypatch, capsys):
    """SLURM signals every process of the job step, W&B's service (``wandb-core``, a Go binary that
    dies of SIGTERM whatever it inherits) included: the rank must still log, finish its step and
    checkpoint, so the logger goes on with metrics.jsonl alone (issue #25)."""
    import os
    import signal

    import psutil

    monkeypatch.setenv("WANDB_SILENT", "true")
    log = RunLogger(LoggingConfig(wandb_mode="offline", console=False), tmp_path / "run")
    log.log(1, {"x": 1.0})
    for child in psutil.Process().children(recursive=True):
        if "wandb" in child.name():
            os.kill(child.pid, signal.SIGTERM)
            child.wait(60)
    log.log(2, {"x": 2.0})
    log.log(3, {"x": 3.0})
    log.close()
    assert [r["step"] for r in read_jsonl_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    assert "W&B stopped working at step 2" in capsys.readouterr().err
    # A module W&B watches, imported after its service died (the checkpoint's torch modules at the
    # step's save), must import: the dead run's telemetry hooks are gone.
    import types

    from wandb.sdk.lib import import_hooks

    import_hooks.notify_module_loaded(types.ModuleType("torch"))
    # ... and a child this process starts later (a rank, a run of the study) does not inherit the
    # dead service's socket: it starts its own (a run in a child failed on it before).
    assert "WANDB_SERVICE" not in os.environ
    again = RunLogger(LoggingConfig(wandb_mode="offline", console=False), tmp_path / "next")
    again.log(1, {"x": 4.0})
    again.close()
    assert [r["x"] for r in read_wandb_history(again.wandb_dir)] == [4.0]


def _kill_wandb_service() -> None:
    import os
    import signal

    import psutil

    for child in psutil.Process().children(recursive=True):
        if "wandb" in child.name():
            os.kill(child.pid, signal.SIGTERM)
            child.wait(60)


def test_a_resume_gives_wandb_the_rows_an_attempt_lost_with_its_service(tmp_path, monkeypatch, capsys):
    """SLURM's SIGTERM kills W&B's service with the step, so W&B never writes that attempt's later
    rows; metrics.jsonl has them. The resumed attempt logs them again from metrics.jsonl: W&B too
    ends with every step once, with the values of metrics.jsonl (issue #25)."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = RunLogger(LoggingConfig(wandb_mode="offline", console=False), tmp_path / "run")
    first.log(1, {"x": 1.0})
    _kill_wandb_service()
    for step in (2, 3, 4):  # the signal arrives during step 2; the checkpoint is step 3's
        first.log(step, {"x": float(step)})
    first.close()
    assert "W&B stopped working at step 2" in capsys.readouterr().err
    started = int(time.time())  # a new attempt directory (W&B names it by its start second)
    while int(time.time()) == started:
        time.sleep(0.05)
    again = _attempt(tmp_path, [4, 5], 3, run_id=first.run_id, mode="offline", value=100.0)
    # Step 1 may be lost too: the service writes asynchronously, and it died before or after it.
    assert again.backfilled in ([1, 2, 3], [2, 3]), again.backfilled
    assert f"logged steps {again.backfilled[0]}..3 again from metrics.jsonl" in capsys.readouterr().err
    hist = [(int(r["_step"]), r["x"]) for r in read_wandb_history(first.wandb_dir)]
    want = [(r["step"], r["x"]) for r in read_jsonl_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert hist == want == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 104.0), (5, 105.0)]
    # A later resume with nothing missing logs nothing again.
    started = int(time.time())
    while int(time.time()) == started:
        time.sleep(0.05)
    assert _attempt(tmp_path, [], 5, run_id=first.run_id, mode="offline").backfilled == []
