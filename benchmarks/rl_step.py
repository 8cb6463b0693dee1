"""Per-phase time of an RL step on the tiny config, and the share taken by the correction.

Runs the real loop (Megatron trainer on this CPU, a real SGLang CPU server, FP8 fake-quant sync,
ACRL) for a few steps with its rollouts recorded, then times the correction -- controller
statistics, ACRL weights and every mismatch metric -- on the very same batches, in the same run.
The last line is ``correction share: <correction seconds / step seconds>``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _correction_pass import correction_pass

from megatron_acrl.batch.rollout_batch import load_rollouts
from megatron_acrl.config import load_config
from megatron_acrl.correction import AcrlController
from megatron_acrl.logging import read_jsonl_metrics
from megatron_acrl.train import parse_args, run

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("time/rollout", "time/logprob", "time/train", "time/sync", "time/step")


def correction_seconds(batch, cfg, repeats: int = 20) -> float:
    """Median time of the full correction path on one rollout batch."""
    rollout_logprobs = batch.rollout_logprobs
    noise = torch.randn(rollout_logprobs.shape, generator=torch.Generator().manual_seed(0))
    old_logprobs = rollout_logprobs + 0.01 * noise * batch.loss_mask
    mask = batch.loss_mask > 0
    adv = torch.randn(len(batch), 1).expand_as(rollout_logprobs)
    n_tok, n_seq = int(mask.sum()), int(mask.any(-1).sum())
    ctl = AcrlController(cfg.correction)

    def once() -> None:
        correction_pass(cfg.correction, ctl, old_logprobs, rollout_logprobs, mask, adv, n_tok, n_seq)

    once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_dense.yaml"))
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"training.num_steps={args.steps}",
            "logging.wandb_mode=disabled",
            "training.sft_steps=0",
            "logging.console=false",
            "training.checkpoint_dir=null",
        ]
        cfg = load_config(args.config, overrides)
        run(
            cfg,
            parse_args(
                [
                    "--config",
                    args.config,
                    "--run-dir",
                    f"{tmp}/run",
                    "--save-rollouts",
                    f"{tmp}/rollouts",
                    *overrides,
                ]
            ),
        )
        rows = read_jsonl_metrics(f"{tmp}/run/metrics.jsonl")[1:] or read_jsonl_metrics(
            f"{tmp}/run/metrics.jsonl"
        )
        phase = {k: statistics.mean(r[k] for r in rows) for k in PHASES}
        corr = statistics.mean(
            correction_seconds(load_rollouts(f"{tmp}/rollouts", int(r["step"]) - 1), cfg) for r in rows
        )
    print(f"steps measured: {len(rows)}  (tiny config, 1 trainer rank, CPU)")
    for k in PHASES:
        print(f"{k:>14s}: {phase[k] * 1e3:9.1f} ms")
    print(f"{'correction':>14s}: {corr * 1e3:9.3f} ms (controller stats + ACRL weights + all metrics)")
    print(f"correction share: {corr / phase['time/step']:.6f}")


if __name__ == "__main__":
    main()
