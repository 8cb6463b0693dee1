"""Checkpoint and resume of the whole run. One step directory holds:

* ``policy/`` -- a Megatron distributed checkpoint (``torch_dist``) of the policy: model and
  optimizer as ShardedTensors (loadable under any TP/PP/VPP/EP/DP layout), LR schedule, ACRL
  controller state and optimizer step in its common state;
* ``critic/`` -- the same for the PPO critic (PPO runs only);
* ``driver.pt`` -- rank 0's driver state: RL step, weight version, data position (prompts
  consumed), Python and torch RNG states, W&B run id;
* ``served_weights.pt`` / ``.json`` -- with ``rollout.weight_lag_steps`` > 0, the lagged weight sets
  the servers serve from (:mod:`megatron_acrl.servers.publisher`), so a resume serves exactly them.

* ``manifest.json`` -- size and CRC-32 of every file above (:mod:`megatron_acrl.megatron.step_manifest`).

Written atomically (``megatron_acrl.megatron.checkpoint.save_step_atomically``): everything goes into
``.tmp-step_<n>/``, is fsynced, renamed to ``step_<n>/``, and only then ``latest.json`` is replaced;
a crash at any point leaves the previous checkpoint as the one that resumes. A resume loads the
newest *intact* step (every file there, with its size and checksum), passing over and naming damaged
newer ones (kept, never loaded or deleted); it refuses a fresh run (``training.resume: false``) where
checkpoints are, and a resume whose config changes the model or the data (:data:`RESUME_KEYS`).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_acrl.batch.staleness import parse_version
from megatron_acrl.config import Config, ConfigError, config_to_dict
from megatron_acrl.config.resume_keys import FIXED_ON_RESUME, RESUME_KEYS
from megatron_acrl.megatron.checkpoint import CheckpointSpaceError
from megatron_acrl.run.context import RunContext, prompt_stream
from megatron_acrl.servers.publisher import WeightPublisher, check_resumable
from megatron_acrl.world.distributed import broadcast_object, log0


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
    uid]) admitted but not trained, which a resume generates again (:mod:`megatron_acrl.rollout.producer`;
    agent groups as whole trajectories from their prompts: a trajectory in flight at the checkpoint
    is never saved half done, docs/agents.md)."""

    def __post_init__(self) -> None:
        if isinstance(self.weight_version, str):  # checkpoints before integer versions: "step-<v>"
            self.weight_version = parse_version(self.weight_version)


def checkpoint_due(ctx: RunContext, step: int) -> bool:
    """A periodic checkpoint is due after ``step`` (``training.save_interval``)."""
    t = ctx.cfg.training
    return bool(t.checkpoint_dir) and t.save_interval > 0 and step % t.save_interval == 0


def save_checkpoint(
    ctx: RunContext, state: DriverState, publisher: WeightPublisher | None = None
) -> Path | None:
    """Write a checkpoint of ``state.step`` (every rank calls it), with the lagged weight sets of
    ``publisher`` when it keeps any."""
    directory = ctx.cfg.training.checkpoint_dir
    if not directory:
        return None

    # Captured before anything is written, so the saved RNG states are the loop's, whatever the
    # savers do with the generators.
    payload = {
        "driver": asdict(state),
        "python_rng": random.getstate(),
        "torch_rng": torch.get_rng_state(),
        "config": config_to_dict(ctx.cfg),  # a resume that changes the model or the data is refused
    }

    def write_driver(step_dir: Path) -> None:
        if ctx.rank == 0:
            torch.save(payload, step_dir / "driver.pt")

    writers = [write_driver]
    if publisher is not None:
        writers.append(publisher.write)
    if ctx.critic is not None:  # into the same step directory, under the same commit
        writers.append(lambda step_dir: ctx.critic.save_dist(step_dir / ctx.critic.ckpt_kind))
    try:
        path = ctx.policy.save_checkpoint(directory, also=writers)  # policy/, writers, commit
    except CheckpointSpaceError as err:  # checkpoint.py knows the directory; the user counts RL steps
        raise CheckpointSpaceError(f"RL step {state.step}: {err}") from None
    ctx.last_checkpoint_step = state.step
    log0(f"checkpoint: step {state.step} -> {path}")
    return path


def resumable_step_dir(cfg: Config, *, checksums: bool = True, report: bool = True) -> Path | None:
    """The step directory a run of ``cfg`` resumes from: the newest intact committed step (None: it
    starts fresh). A damaged newer step is passed over and named (log), never loaded; when every step
    is damaged, a ConfigError names each damaged file and the fix. ``checksums=False`` checks
    presence and sizes only (cheap: :func:`check_resume` on every rank before anything starts; the
    load re-verifies every checksum on rank 0); ``report``: log the steps passed over."""
    t = cfg.training
    if not (t.resume and t.checkpoint_dir and Path(t.checkpoint_dir).is_dir()):
        return None
    from megatron_acrl.megatron.step_manifest import select_step_dir

    sel = select_step_dir(t.checkpoint_dir, checksums=checksums)
    if sel.step_dir is None and sel.passed_over:
        raise ConfigError(
            [
                (
                    "training.checkpoint_dir",
                    f"{t.checkpoint_dir} holds no intact checkpoint: "
                    + "; ".join(sel.passed_over)
                    + ". They are kept as they are: restore the damaged files (from a backup), or start "
                    "fresh in a new training.checkpoint_dir",
                )
            ]
        )
    if report and sel.passed_over:
        for line in sel.passed_over:
            log0(f"checkpoint passed over: {line}; kept, not loaded")
        log0(f"resuming from the newest intact checkpoint, {sel.step_dir}")
    return sel.step_dir


def check_resume(cfg: Config, step_dir: Path | None = None) -> None:
    """Before anything starts (and again on the step the load chose): refuse a fresh run in a
    directory holding checkpoints, a resume with changed model or data keys, and a resume this config
    cannot continue exactly (a weight lag the checkpoint's stored weights cannot serve, async
    groups in sync mode). A ConfigError names the field and the fix."""
    _refuse_overwrite(cfg)
    step_dir = step_dir or resumable_step_dir(cfg, checksums=False, report=False)
    if step_dir is None:
        return
    driver = step_dir / "driver.pt"
    payload = torch.load(driver, weights_only=False) if driver.exists() else {}
    check_resumable(cfg, step_dir, trainer_version_of(step_dir, payload))
    _refuse_changes(cfg, step_dir, payload.get("config"))
    _refuse_other_base(cfg, step_dir)
    pending = (payload.get("driver", {}).get("producer") or {}).get("pending")
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


def trainer_version_of(step_dir: Path, payload: dict[str, Any]) -> int:
    """The trainer's weight version (RL steps) a checkpoint holds: its driver state's, which the
    lagged weight sets are numbered in. The step directory's number counts optimizer steps (RL steps
    x optimizer steps per RL step), so it is only the fallback of a checkpoint without a driver
    state (``step_<n>``, or ``.trash-step_<n>``)."""
    version = (payload.get("driver") or {}).get("weight_version")
    if version is None:
        return int(step_dir.name.rsplit("_", 1)[1])
    return parse_version(version) if isinstance(version, str) else int(version)


def _refuse_overwrite(cfg: Config) -> None:
    """``training.resume: false`` where checkpoints are: a fresh run would overwrite their steps and
    repoint ``latest.json`` (another run's, or this one's earlier)."""
    from megatron_acrl.megatron.step_manifest import has_checkpoints

    t = cfg.training
    if t.resume or not t.checkpoint_dir or not has_checkpoints(Path(t.checkpoint_dir)):
        return
    raise ConfigError(
        [
            (
                "training.resume",
                f"is false, but {t.checkpoint_dir} holds checkpoints a fresh run would overwrite: set "
                "training.resume=true to continue them, or point training.checkpoint_dir at a new "
                "directory (a relative one lives in the run directory), or move them away",
            )
        ]
    )


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _refuse_changes(cfg: Config, step_dir: Path, saved: dict[str, Any] | None) -> None:
    """A resume must keep every key that changes the model or the data (:data:`RESUME_KEYS`), but
    those ``training.resume_allow_changes`` names; checkpoints before the config was saved: no check."""
    if saved is None:
        return
    old, new = _flat(saved), _flat(config_to_dict(cfg))
    allowed = set(cfg.training.resume_allow_changes)
    changed = sorted(
        k
        for k in old.keys() | new.keys()
        if k.startswith(RESUME_KEYS) and k not in allowed and old.get(k) != new.get(k)
    )
    if changed:
        raise ConfigError(
            [
                (
                    k,
                    f"the checkpoint {step_dir} was written with {old.get(k)!r}, this run has "
                    f"{new.get(k)!r}: it changes the model or the data, so the resumed run would not be "
                    "the one checkpointed",
                )
                for k in changed
            ]
            + [("training.resume_allow_changes", _changes_hint(changed))]
        )


def _changes_hint(changed: list[str]) -> str:
    """The fix for a resume that changes ``changed``: a key setting the checkpoint's shapes
    (:data:`FIXED_ON_RESUME`) can only be set back or started fresh; the others may be accepted."""
    fixed = [k for k in changed if k in FIXED_ON_RESUME]
    free = [k for k in changed if k not in FIXED_ON_RESUME]
    hint = "set the key(s) back, or start fresh in a new training.checkpoint_dir"
    if fixed:
        hint += f" ({', '.join(fixed)} can never change on resume: the checkpoint's tensors would not load)"
    if free:
        hint += f"; or accept the change explicitly: training.resume_allow_changes=[{', '.join(free)}]"
    return hint


def load_driver_state(ctx: RunContext) -> tuple[DriverState, Path | None]:
    """Resume from the newest intact checkpoint when ``training.resume`` and one exists; else a fresh
    state. Rank 0 removes partial saves, verifies every checksum and chooses the step; every rank
    loads that one. Returns the state and the step directory it came from (None: fresh)."""
    t = ctx.cfg.training
    chosen: Any = None
    if ctx.rank == 0:
        if t.checkpoint_dir:
            from megatron_acrl.megatron.checkpoint import remove_partial_saves

            for path in remove_partial_saves(t.checkpoint_dir):
                log0(f"removed the partial save {path} (a save that crashed or ran out of disk)")
        try:
            chosen = (resumable_step_dir(ctx.cfg), None)
        except ConfigError as err:
            chosen = (None, err.errors)
    step_dir, refused = broadcast_object(chosen)  # the same step (or the same refusal) on every rank
    if refused:
        raise ConfigError(refused)
    if step_dir is None:
        _refuse_overwrite(ctx.cfg)
        return DriverState(), None
    check_resume(ctx.cfg, step_dir)
    step = int(step_dir.name.rsplit("_", 1)[1])
    if not ctx.policy.load_checkpoint(t.checkpoint_dir, step):
        return DriverState(), None
    if ctx.critic is not None:
        ctx.critic.load_checkpoint(t.checkpoint_dir, step)
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
    ctx.last_checkpoint_step = state.step  # the logger supersedes the rows logged after it
    log0(f"resumed from {step_dir.name}: step {state.step}, weight version {state.weight_version}")
    return state, step_dir


def export_hf(ctx: RunContext, out_dir: str | Path, *, merged: bool = False) -> Path:
    """Write the current policy as an HF model directory (config and tokenizer of the served model,
    weights gathered from every TP/PP/EP shard). Every rank calls it; rank 0 writes.

    With ``model.lora`` (and not ``merged``): a PEFT adapter directory instead (``adapter_config.json``
    naming the base, ``adapter_model.safetensors``), which ``peft`` loads onto the base model.
    ``merged`` (``--export-hf-merged``): the base with the adapters folded in, a plain HF model."""
    from megatron_acrl.megatron import lora

    if ctx.cfg.model.lora is None or merged:
        out = ctx.policy.save_hf(out_dir, base_dir=ctx.model_dir, dtype=torch.bfloat16, merged=True)
        log0(f"exported the policy{' (adapters merged)' if ctx.cfg.model.lora else ''} to {out}")
        return out
    state = ctx.policy.adapter_state(dst=0)
    out = Path(out_dir)
    if ctx.rank == 0:
        lora.write_peft_dir(state, lora.peft_adapter_config(ctx.cfg, str(ctx.model_dir)), out)
    broadcast_object(None)  # the other ranks wait for rank 0's directory
    log0(f"exported the policy's LoRA adapters (PEFT) to {out}")
    return out


def _refuse_other_base(cfg: Config, step_dir: Path) -> None:
    """A LoRA checkpoint's adapters resume only on their own base: refuse another one (by its weights'
    fingerprint) before anything starts. The load checks it again (``checkpoint.check_compatible``)."""
    if cfg.model.lora is None or not cfg.model.hf_path or not (step_dir / "policy").is_dir():
        return
    from megatron_acrl.megatron import checkpoint, lora

    meta = checkpoint.load_common_state(step_dir / "policy").get("acrl_meta") or {}
    saved = ((meta.get("lora") or {}).get("base") or {}).get("sha256")
    mine = lora.base_reference(cfg.model.hf_path)["sha256"]
    if saved is not None and saved != mine:
        raise ConfigError(
            [
                (
                    "model.hf_path",
                    f"the checkpoint {step_dir} holds LoRA adapters trained on another base (fingerprint "
                    f"{saved}; {cfg.model.hf_path} has {mine}): adapters fit only their own base; point "
                    "model.hf_path at the checkpoint's base, or start fresh in a new training.checkpoint_dir",
                )
            ]
        )
