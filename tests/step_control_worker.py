"""gloo worker of ``tests/test_step_control.py``: a 2-rank data-parallel Policy with the drift-budget
step controller; records the optimizer's learning rates around one step and resumes its state."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from mcore_worker import SEED, main, make_batch, make_config
from megatron.core import parallel_state


def _policy(cfg: Any) -> Any:
    from megatron_acrl.megatron.base import initialize_parallel
    from megatron_acrl.megatron.policy import Policy

    initialize_parallel(cfg.parallel, SEED)
    return Policy(cfg)


def scenario_step_control(args: dict[str, Any]) -> dict[str, Any]:
    base = make_config("qwen2", {})
    corr = dataclasses.replace(
        base.correction, method="tis", batch_normalize=False, step_control="drift_budget"
    )
    cfg = dataclasses.replace(base, correction=corr)
    trainer = _policy(cfg)
    batch = make_batch(cfg.model.vocab_size)
    mask = batch["loss_mask"]
    batch["old_logprobs"] = trainer.forward_logprobs(batch)["logprobs"] * mask
    versions = torch.zeros_like(batch["tokens"])
    fresh = dict(
        batch,
        rollout_logprobs=(batch["old_logprobs"] + 0.02 * batch["noise"]) * mask,
        token_versions=versions,
    )
    stale = dict(
        batch, rollout_logprobs=(batch["old_logprobs"] + 0.5 * batch["noise"]) * mask, token_versions=versions
    )
    out: dict[str, Any] = {}
    trainer.update_controller(fresh, trainer_version=0)  # lag 0: the reference drift
    out["lag0_scale"] = trainer.lr_scale
    trainer.update_controller(stale, trainer_version=8)  # sampled 8 versions ago
    out["scale"] = trainer.lr_scale
    groups = trainer.optimizer.param_groups
    out["lrs_before"] = [g["lr"] for g in groups]
    seen: list[list[float]] = []
    step = trainer.optimizer.step

    def spy() -> Any:
        seen.append([g["lr"] for g in groups])
        return step()

    trainer.optimizer.step = spy
    out["metrics"] = trainer.train_step(stale)
    out["lrs_in_step"] = seen[0]
    out["lrs_after"] = [g["lr"] for g in groups]
    out["lrs_sched"] = [trainer.scheduler.get_lr(g) * g.get("lr_mult", 1.0) for g in groups]
    out["state"] = trainer.step_controller.state_dict()
    ckpt = Path(args["tmp"]) / "ckpt"
    trainer.save_checkpoint(ckpt)
    del trainer
    parallel_state.destroy_model_parallel()
    again = _policy(cfg)
    again.load_checkpoint(ckpt)
    out["resumed"] = again.step_controller.state_dict()
    del again
    parallel_state.destroy_model_parallel()
    out["both"] = _with_acrl(base, fresh, stale, Path(args["tmp"]) / "ckpt_no_step_control")
    return out


def _with_acrl(base: Any, fresh: dict, stale: dict, ckpt: Path) -> dict[str, Any]:
    """ACRL's controller and the step controller side by side, and ACRL alone (no step control: the
    rate untouched); ACRL alone's checkpoint (a run from before step control) then resumed with step
    control on: ACRL's state comes back, the step controller starts fresh (``pre_step_resumed``)."""
    res: dict[str, Any] = {}
    for name, step_control in (("both", "drift_budget"), ("acrl", "none")):
        corr = dataclasses.replace(base.correction, batch_normalize=False, step_control=step_control)
        trainer = _policy(dataclasses.replace(base, correction=corr))
        m0 = trainer.update_controller(fresh, trainer_version=0)
        m1 = trainer.update_controller(stale, trainer_version=8)
        lr = trainer.optimizer.param_groups[0]["lr"]
        metrics = trainer.train_step(stale)
        res[name] = {"m0": m0, "m1": m1, "lr": lr, "metrics": metrics, "scale": trainer.lr_scale}
        if step_control == "none":
            res["acrl_state"] = trainer.controller.state_dict()
            trainer.save_checkpoint(ckpt)
        del trainer
        parallel_state.destroy_model_parallel()
    corr = dataclasses.replace(base.correction, batch_normalize=False, step_control="drift_budget")
    again = _policy(dataclasses.replace(base, correction=corr))
    again.load_checkpoint(ckpt)
    res["pre_step_resumed"] = {
        "acrl": again.controller.state_dict(),
        "step": again.step_controller.state_dict(),
        "lr_scale": again.lr_scale,
    }
    del again
    parallel_state.destroy_model_parallel()
    return res


if __name__ == "__main__":
    main(globals())
