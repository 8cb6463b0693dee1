"""W&B offline run and metrics.jsonl are written and read back."""

from __future__ import annotations

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
