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
