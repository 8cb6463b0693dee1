"""Run plots are drawn from metrics.jsonl (what `make demo` and the study report use)."""

from __future__ import annotations

import json

from megatron_acrl.plots import main, plot_runs


def test_plots_from_metrics(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": s, "reward/mean": 0.1 * s, "mismatch/k3_kl": 1e-3, "acrl/y_over_x": "nan"}
        for s in range(1, 13)
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    files = plot_runs([run], tmp_path / "plots")
    names = {f.name for f in files}
    assert {"reward_mean.png", "mismatch_k3_kl.png"} <= names
    assert "acrl_y_over_x.png" not in names  # no finite values: no empty figure
    assert all(f.stat().st_size > 1000 for f in files)
    assert main([str(run)]) == 0 and (run / "plots" / "reward_mean.png").exists()
    # steps 1..12 with reward 0.1 * step: first five average 0.3, last five 1.0
    assert "0.300 -> 1.000 (+0.700)" in capsys.readouterr().out
