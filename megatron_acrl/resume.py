"""Checkpoint and resume of the whole run. One step directory holds:

* ``policy/`` -- a Megatron distributed checkpoint (``torch_dist``) of the policy: model and
  optimizer as ShardedTensors (loadable under any TP/PP/VPP/EP/DP layout), LR schedule, ACRL
  controller state and optimizer step in its common state;
* ``critic/`` -- the same for the PPO critic (PPO runs only);
* ``driver.pt`` -- rank 0's driver state: RL step, weight version, data position (prompts
  consumed), Python and torch RNG states, W&B run id;
* ``served_weights.pt`` / ``.json`` -- with ``rollout.weight_lag_steps`` > 0, the lagged weight sets
  the servers serve from (:mod:`megatron_acrl.served_weights`), so a resume serves exactly them.

Written atomically (``megatron_acrl.megatron.checkpoint.save_step_atomically``): everything goes into
``.tmp-step_<n>/``, is fsynced, renamed to ``step_<n>/``, and only then ``latest.json`` is replaced;
a crash at any point leaves the previous checkpoint as the one that resumes.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_acrl.config import Config, ConfigError
from megatron_acrl.context import RunContext, prompt_stream
from megatron_acrl.distributed import broadcast_object, log0
from megatron_acrl.served_weights import ServedWeights, check_resumable
from megatron_acrl.staleness import parse_version


@dataclass
class DriverState:
    """What the driver needs to continue a run exactly."""

    step: int = 0
    weight_version: int = 0
    """The trainer's weight version: RL steps its weights have seen (``docs/async.md``)."""
    prompts_consumed: int = 0
    """Prompts drawn from the run's prompt stream (async: admitted, trained or not)."""
    wandb_id: str | None = None
    producer: dict[str, Any] | None = None
    """The async producer's position: ``next_gid`` and the ``pending`` groups ([gid, text, answer,
    uid]) admitted but not trained, which a resume generates again (:mod:`megatron_acrl.producer`)."""

    def __post_init__(self) -> None:
        if isinstance(self.weight_version, str):  # checkpoints before integer versions: "step-<v>"
            self.weight_version = parse_version(self.weight_version)


def checkpoint_due(ctx: RunContext, step: int) -> bool:
    """A periodic checkpoint is due after ``step`` (``training.save_interval``)."""
    t = ctx.cfg.training
    return bool(t.checkpoint_dir) and t.save_interval > 0 and step % t.save_interval == 0


def save_checkpoint(ctx: RunContext, state: DriverState, served: ServedWeights | None = None) -> Path | None:
    """Write a checkpoint of ``state.step`` (every rank calls it), with the lagged weight sets of
    ``served`` when it keeps any."""
    directory = ctx.cfg.training.checkpoint_dir
    if not directory:
        return None

    # Captured before anything is written, so the saved RNG states are the loop's, whatever the
    # savers do with the generators.
    payload = {"driver": asdict(state), "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()}

    def write_driver(step_dir: Path) -> None:
        if ctx.rank == 0:
            torch.save(payload, step_dir / "driver.pt")

    writers = [write_driver]
    if served is not None:
        writers.append(served.write)
    if ctx.critic is not None:  # into the same step directory, under the same commit
        writers.append(lambda step_dir: ctx.critic.save_dist(step_dir / ctx.critic.ckpt_kind))
    path = ctx.policy.save_checkpoint(directory, also=writers)  # policy/, writers, commit
    ctx.last_checkpoint_step = state.step
    log0(f"checkpoint: step {state.step} -> {path}")
    return path


def resumable_step_dir(cfg: Config) -> Path | None:
    """The step directory a run of ``cfg`` resumes from (None: it starts fresh)."""
    t = cfg.training
    if not (t.resume and t.checkpoint_dir and (Path(t.checkpoint_dir) / "latest.json").exists()):
        return None
    from megatron_acrl.megatron.checkpoint import resolve_step_dir

    return resolve_step_dir(t.checkpoint_dir)


def check_resume(cfg: Config) -> None:
    """Before anything starts: refuse a resume this config cannot continue exactly (a weight lag
    the checkpoint's stored weights cannot serve). A ConfigError names the field."""
    step_dir = resumable_step_dir(cfg)
    if step_dir is None:
        return
    check_resumable(cfg, step_dir, int(step_dir.name.rsplit("_", 1)[1]))  # step_<n> (or .trash-step_<n>)
    driver = step_dir / "driver.pt"
    saved = torch.load(driver, weights_only=False)["driver"] if driver.exists() else {}
    pending = (saved.get("producer") or {}).get("pending")
    if pending and cfg.rollout.mode == "sync":
        raise ConfigError(
            [
                (
                    "rollout.mode",
                    f"the checkpoint {step_dir} was written in async mode with {len(pending)} admitted, "
                    "untrained prompt groups, which only the async producer generates again: resume with "
                    "rollout.mode=async (or start a fresh run)",
                )
            ]
        )


def load_driver_state(ctx: RunContext) -> tuple[DriverState, Path | None]:
    """Resume from the latest checkpoint when ``training.resume`` and one exists; else a fresh state.
    Returns the state and the step directory it came from (None: fresh)."""
    t = ctx.cfg.training
    step_dir = resumable_step_dir(ctx.cfg)
    if step_dir is None or not ctx.policy.load_checkpoint(t.checkpoint_dir):
        return DriverState(), None
    if ctx.critic is not None:
        ctx.critic.load_checkpoint(t.checkpoint_dir)
    payload: Any = None
    if ctx.rank == 0:
        path = step_dir / "driver.pt"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: the checkpoint {step_dir.name} has no driver state")
        payload = torch.load(path, weights_only=False)
        random.setstate(payload["python_rng"])
        torch.set_rng_state(payload["torch_rng"])
    driver = broadcast_object(payload["driver"] if payload is not None else None)
    state = DriverState(**driver)
    if ctx.prompt_stream is not None:  # rank 0: the data continues where the checkpoint left it
        ctx.prompt_stream = prompt_stream(ctx.task, ctx.cfg.training.seed, state.prompts_consumed)
    ctx.last_checkpoint_step = state.step
    if ctx.rank == 0:
        forget_steps_after(ctx.run_dir / "metrics.jsonl", state.step)
    log0(f"resumed from {step_dir.name}: step {state.step}, weight version {state.weight_version}")
    return state, step_dir


def forget_steps_after(metrics: Path, step: int) -> int:
    """Drop the rows of steps after ``step`` from a run's ``metrics.jsonl`` (steps a crash lost after
    the checkpoint it resumes from: they are trained again), so every step is there exactly once.
    Rewritten atomically; returns the rows dropped."""
    if not metrics.is_file():
        return 0
    lines = metrics.read_text().splitlines()
    keep = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= step]
    dropped = sum(1 for ln in lines if ln.strip()) - len(keep)
    if dropped:
        tmp = metrics.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        tmp.replace(metrics)
        log0(f"{metrics}: dropped {dropped} rows of steps after {step} (not in the checkpoint)")
    return dropped


def export_hf(ctx: RunContext, out_dir: str | Path) -> Path:
    """Write the current policy as an HF model directory (config and tokenizer of the served model,
    weights gathered from every TP/PP/EP shard). Every rank calls it; rank 0 writes."""
    out = ctx.policy.save_hf(out_dir, base_dir=ctx.model_dir, dtype=torch.bfloat16)
    log0(f"exported the policy to {out}")
    return out
