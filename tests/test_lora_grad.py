"""LoRA's training path against an independent float64 reference (issue #35; docs/lora.md "Learning").

The layout tests compare LoRA layouts with each other; a bug shared by every layout (a gradient of
the wrong direction or scale, the adapters' place in the optimizer) would pass them. Here one rank
trains, through the product's own ``Policy.train_step`` (loss, DDP, grad clipping, Megatron's Adam):

* a LoRA policy (qwen2, rank 8, alpha 16, every target) whose adapters have a non-zero random B;
* a full-parameter policy loaded with the merged weights ``W + s B A`` (``s = alpha / r``), the
  same model function, so its weight gradient ``G = dL/dW`` is the adapted layers' gradient.

The chain rule then gives the adapters' gradients in float64, from G alone: ``dL/dB = s G A^T`` and
``dL/dA = s B^T G`` (summed over q/k/v, gate/up: one A per fused layer). Both runs take one step of
the Adam trick (``mcore_worker``: lr 1e3, eps 1e3, first step ``u = lr g / (|g| + eps)``), inverted
exactly to read each gradient back from the update.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_launch import launch

PREFIX = "base_model.model."


def _step(trainer: Any) -> None:
    """One RL step as ``lora_worker.run_lora_case`` takes it (controller updates, then train_step)."""
    from mcore_worker import make_batch

    batch = make_batch(trainer.cfg.model.vocab_size)
    mask = batch["loss_mask"]
    batch["old_logprobs"] = trainer.forward_logprobs(batch)["logprobs"] * mask
    for noise in (0.02, 0.05):
        step = dict(batch, rollout_logprobs=(batch["old_logprobs"] + noise * batch["noise"]) * mask)
        trainer.update_controller(step)
    trainer.train_step(step)


def _groups(trainer: Any) -> list[dict[str, float]]:
    """Every optimizer param group's lr, weight decay, lr multiplier and size."""
    out = []
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for g in opt.param_groups:
            out.append(
                {
                    "lr": float(g["lr"]),
                    "weight_decay": float(g["weight_decay"]),
                    "lr_mult": float(g.get("lr_mult", 1.0)),
                    "n": len(g["params"]),
                }
            )
    return out


def scenario_grad(args: dict[str, Any]) -> dict[str, Any]:
    """The LoRA policy's adapter update and the merged full policy's weight update (one rank)."""
    from lora_worker import _frozen_report, _full_config, lora_config, random_adapters
    from mcore_worker import SEED
    from megatron.core import parallel_state

    from megatron_acrl.megatron.base import initialize_parallel
    from megatron_acrl.megatron.policy import Policy

    cfg = lora_config("qwen2", {})
    initialize_parallel(cfg.parallel, SEED)
    lora = Policy(cfg)
    adapters = random_adapters(lora)
    lora.load_adapter_state(adapters)
    merged = {k: v.detach().clone() for k, v in lora.hf_weights(all_stages=True, merged=True)}
    out: dict[str, Any] = {"frozen": _frozen_report(lora), "groups": _groups(lora)}
    _step(lora)
    out["adapters_after"] = lora.adapter_state(dst=None)
    del lora
    parallel_state.destroy_model_parallel()

    initialize_parallel(cfg.parallel, SEED)
    full = Policy(_full_config("qwen2", {}))
    full.load_hf(merged)
    _step(full)
    out["full_after"] = {k: v.detach().clone() for k, v in full.hf_weights(all_stages=True)}
    del full
    parallel_state.destroy_model_parallel()
    t = cfg.training
    out.update(
        adapters=adapters,
        merged=merged,
        scale=cfg.model.lora.alpha / cfg.model.lora.rank,
        lr=t.lr,
        eps=t.adam_eps,
        weight_decay=t.weight_decay,
    )
    return out


@pytest.fixture(scope="module")
def grad_run() -> dict[str, Any]:
    return launch("grad", 1, {}, worker=Path(__file__))[0]


def _grad(before: torch.Tensor, after: torch.Tensor, lr: float, eps: float) -> torch.Tensor:
    """The gradient of one Adam-trick step: ``u = before - after = lr g / (|g| + eps)``, inverted."""
    u = before.double() - after.double()
    return eps * u / (lr - u.abs())


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


def test_adapters_alone_train_with_the_configured_lr_and_weight_decay(grad_run: dict[str, Any]) -> None:
    f = grad_run["frozen"]
    assert not f["trainable_not_lora"] and not f["lora_not_trainable"], f
    assert not f["optimizer_not_lora"] and f["optimizer_count"] == f["lora_count"] > 0, f
    groups = [g for g in grad_run["groups"] if g["n"]]
    assert sum(g["n"] for g in groups) == f["lora_count"], groups
    for g in groups:  # no lr scaling and the configured decay on every adapter (2-D weights)
        assert g["lr"] == grad_run["lr"] and g["lr_mult"] == 1.0, g
        assert g["weight_decay"] == grad_run["weight_decay"], g


def test_adapter_gradients_match_the_chain_rule_of_the_merged_model(grad_run: dict[str, Any]) -> None:
    r = grad_run
    s, lr, eps = r["scale"], r["lr"], r["eps"]
    ad, after = r["adapters"], r["adapters_after"]
    fused_a: dict[str, torch.Tensor] = {}  # dL/dA of one fused layer: the sum over its parts
    fused_of: dict[str, str] = {}
    checked = 0
    for name_b in sorted(n for n in ad if ".lora_B." in n):
        hf = name_b[len(PREFIX) :].replace(".lora_B.weight", ".weight")
        name_a = name_b.replace(".lora_B.", ".lora_A.")
        a, b = ad[name_a].double(), ad[name_b].double()
        g_w = _grad(r["merged"][hf], r["full_after"][hf], lr, eps)  # [out, in]
        ref_b = s * g_w @ a.T  # [out, r]
        got_b = _grad(b, after[name_b], lr, eps)
        assert _rel(got_b, ref_b) < 1e-3, (name_b, _rel(got_b, ref_b), ref_b.norm().item())
        fused = re.sub(r"\.(q|k|v)_proj\.", ".qkv.", re.sub(r"\.(gate|up)_proj\.", ".gate_up.", name_a))
        fused_a[fused] = fused_a.get(fused, 0) + s * b.T @ g_w  # [r, in]
        fused_of[name_a] = fused
        checked += 1
    for name_a, fused in fused_of.items():
        got_a = _grad(ad[name_a], after[name_a], lr, eps)
        assert _rel(got_a, fused_a[fused]) < 1e-3, (name_a, _rel(got_a, fused_a[fused]))
    assert checked == 7 * 4, checked  # q, k, v, o, gate, up, down on each of the 4 layers


if __name__ == "__main__":  # the gloo worker of this file's scenario (dist_launch)
    sys.path.insert(0, str(Path(__file__).parent))
    from mcore_worker import main

    main({"scenario_grad": scenario_grad})
