"""Checkpoint and resume of the whole run: the trainer's state (model, optimizer, LR schedule, ACRL
controller, step; per rank) plus the driver's (RL step, weight version, data position, RNG, W&B run).

Written atomically: every file of ``step_<n>/`` is complete before ``latest.json`` is replaced (a
rename), so a crash mid-write leaves the previous checkpoint as the one that resumes.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_acrl.runtime import RunContext, broadcast_object, log0, skip_prompts


@dataclass
class DriverState:
    """What the driver needs to continue a run exactly."""

    step: int = 0
    weight_version: str = "step-0"
    prompts_consumed: int = 0
    wandb_id: str | None = None


def _step_dir(ctx: RunContext, step: int) -> Path:
    return Path(ctx.cfg.training.checkpoint_dir) / f"step_{step:08d}"  # type: ignore[arg-type]


def save_checkpoint(ctx: RunContext, state: DriverState) -> Path | None:
    """Write a checkpoint of ``state.step`` (every rank calls it)."""
    directory = ctx.cfg.training.checkpoint_dir
    if not directory:
        return None
    if ctx.rank == 0:
        d = _step_dir(ctx, ctx.trainer.step)
        d.mkdir(parents=True, exist_ok=True)
        payload = {
            "driver": asdict(state),
            "python_rng": random.getstate(),
            "torch_rng": torch.get_rng_state(),
        }
        tmp = d / "driver.pt.tmp"
        torch.save(payload, tmp)
        tmp.replace(d / "driver.pt")
    if ctx.critic is not None:  # into the same step_<n>/, before latest.json commits it
        ctx.critic.save_checkpoint(directory, step=ctx.trainer.step)
    path = ctx.trainer.save_checkpoint(directory)  # rank files, barrier, then latest.json
    ctx.last_checkpoint_step = state.step
    log0(f"checkpoint: step {state.step} -> {path}")
    return path


def load_driver_state(ctx: RunContext) -> DriverState:
    """Resume from the latest checkpoint when ``training.resume`` and one exists; else a fresh state."""
    t = ctx.cfg.training
    if not (t.resume and t.checkpoint_dir and (Path(t.checkpoint_dir) / "latest.json").exists()):
        return DriverState()
    if not ctx.trainer.load_checkpoint(t.checkpoint_dir):
        return DriverState()
    if ctx.critic is not None:
        ctx.critic.load_checkpoint(t.checkpoint_dir)
    latest = json.loads((Path(t.checkpoint_dir) / "latest.json").read_text())
    payload: Any = None
    if ctx.rank == 0:
        path = Path(t.checkpoint_dir) / latest["dir"] / "driver.pt"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: the checkpoint {latest['dir']} is incomplete")
        payload = torch.load(path, weights_only=False)
        random.setstate(payload["python_rng"])
        torch.set_rng_state(payload["torch_rng"])
    driver = broadcast_object(payload["driver"] if payload is not None else None)
    state = DriverState(**driver)
    skip_prompts(ctx, state.prompts_consumed)
    ctx.last_checkpoint_step = state.step
    log0(f"resumed from {latest['dir']}: step {state.step}, weights {state.weight_version}")
    return state


def export_hf(ctx: RunContext, out_dir: str | Path) -> Path:
    """Write the current policy as an HF model directory (config and tokenizer of the served model,
    weights gathered from every TP/PP/EP shard). Every rank calls it; rank 0 writes."""
    from megatron_acrl.sft import save_hf_dir

    weights = ctx.trainer.hf_weights(all_stages=True)
    if ctx.rank == 0:
        save_hf_dir(weights, ctx.model_dir, out_dir)
        log0(f"exported the policy to {out_dir}")
    else:
        for _ in weights:  # the gathers are collectives
            pass
    return Path(out_dir)
