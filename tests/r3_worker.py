"""MoE routing replay scenarios on gloo ranks (run by ``tests/dist_launch.py``, like ``mcore_worker``).

    python tests/r3_worker.py <scenario> '<json args>' <out_dir>     (RANK/WORLD_SIZE/MASTER_* set)

``layouts``: synthetic rollout routing replayed under several layouts of one launch (plain data
parallel first: the reference), R2, activation recompute and misaligned-replay negative controls.
``sglang``: a rollout batch recorded from a real SGLang server, scored by the trainer with replay off
and on (R3), under EP and TP+SP, plus the negative controls.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

warnings.filterwarnings("ignore")

import mcore_worker as mw  # noqa: E402
import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron_acrl.config import Config  # noqa: E402
from megatron_acrl.megatron import routing_replay  # noqa: E402


def _with(cfg: Config, *, replay: str, recompute: str = "none", mbs: int | None = None) -> Config:
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, moe_routing_replay=replay),
        training=dataclasses.replace(
            cfg.training,
            activation_recompute=recompute,
            micro_batch_size=mbs or cfg.training.micro_batch_size,
        ),
    )


def _misalign(trainer: Any, negative: str | None) -> Any:
    """Negative controls: feed the routers a wrong layer order or a wrong token order. Returns an
    undo function."""
    original = routing_replay.micro_batch_indices
    routers = trainer.routing.routers
    layers = [r.layer for r in routers]
    if negative == "layer_order":  # each router gets another layer's routing
        for r, layer in zip(routers, reversed(layers), strict=True):
            r.layer = layer
    elif negative == "token_order":  # batch-major [b, s] instead of Megatron's sequence-major [s, b]

        def batch_major(routing, local, *, sequence_parallel, tp_size, tp_rank):  # noqa: ANN001, ANN202
            x = routing[:, :, local]
            if sequence_parallel and tp_size > 1:
                s = x.shape[1] // tp_size
                x = x[:, tp_rank * s : (tp_rank + 1) * s]
            return x.reshape(-1, x.shape[-1]).to(torch.int64).contiguous()

        routing_replay.micro_batch_indices = batch_major

    def undo() -> None:
        routing_replay.micro_batch_indices = original
        for r, layer in zip(routers, layers, strict=True):
            r.layer = layer

    return undo


def synthetic_routing(n: int, length: int, layers: int, experts: int, k: int) -> torch.Tensor:
    """Random valid top-k sets for every position, -1 on the last position (as SGLang sends)."""
    g = torch.Generator().manual_seed(21)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n * length * layers)])
    out = idx.reshape(n, length, layers, k).to(torch.int16)
    out[:, -1] = -1
    return out


def layout_case(case: dict[str, Any], init: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """One layout: pi_old with replay (observed own routing), routing metrics, one step."""
    from megatron_acrl.megatron.base import initialize_parallel
    from megatron_acrl.megatron.policy import Policy

    base = mw.make_config("moe", case["layout"])
    cfg = _with(base, replay=case["replay"], recompute=case.get("recompute", "none"))
    initialize_parallel(cfg.parallel, mw.SEED)
    trainer = Policy(cfg)
    out: dict[str, Any] = {}
    if init is None:
        out["init"] = {k: v.detach().clone() for k, v in trainer.hf_weights(all_stages=True)}
    else:
        trainer.load_hf(init)
    undo = _misalign(trainer, case.get("negative"))
    try:
        batch = mw.make_batch(cfg.model.vocab_size)
        mask = batch["loss_mask"]
        n, length = batch["tokens"].shape
        batch["routed_experts"] = synthetic_routing(n, length, cfg.model.num_layers, cfg.model.num_experts, 2)
        old = trainer.forward_logprobs(batch)
        batch["old_logprobs"] = old["logprobs"] * mask
        if "recorded_experts" in old:
            batch["recorded_experts"] = old["recorded_experts"]
        batch["rollout_logprobs"] = (batch["old_logprobs"] + 0.05 * batch["noise"]) * mask
        out["routing"] = trainer.routing_metrics(batch)
        own = trainer._own_routing  # this stage's layers, the whole batch
        out["own"] = {layer: own[:, :, i].clone() for i, layer in enumerate(trainer.routing.layers)}
        trainer.update_controller(batch)
        out["metrics"] = trainer.train_step(batch)
        out["old"] = batch["old_logprobs"]
        out["after"] = {k: v.detach().clone() for k, v in trainer.hf_weights(all_stages=True)}
    finally:
        undo()
    del trainer
    parallel_state.destroy_model_parallel()
    return out


def scenario_layouts(args: dict[str, Any]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    init = None
    for case in args["cases"]:  # the first case is the reference and exports the initial weights
        res = layout_case(case, init)
        if init is None:
            init = res["init"]
        results[case["name"]] = res
    return results


def scenario_sglang(args: dict[str, Any]) -> dict[str, Any]:
    """Trainer log-probs of a batch SGLang generated, replay off vs rollout, per layout."""
    from megatron_acrl.batch.rollout_batch import RolloutBatch
    from megatron_acrl.config import load_config
    from megatron_acrl.megatron.base import initialize_parallel
    from megatron_acrl.megatron.policy import Policy

    batch = RolloutBatch.load(args["batch"])
    results: dict[str, Any] = {}
    for case in args["cases"]:
        base = load_config(args["config"], [f"parallel.{k}={v}" for k, v in case["layout"].items()])
        # fp32 compute on the served bf16 weights: the reference closest to exact (as the bridge tests).
        base = dataclasses.replace(base, model=dataclasses.replace(base.model, params_dtype="fp32"))
        cfg = _with(base, replay=case["replay"], mbs=4)
        initialize_parallel(cfg.parallel, mw.SEED)
        trainer = Policy(cfg)
        trainer.load_hf(args["ckpt"])
        undo = _misalign(trainer, case.get("negative"))
        try:
            tb = batch.tensors()
            tb["old_logprobs"] = trainer.forward_logprobs(tb)["logprobs"]
            res = {"old": tb["old_logprobs"], "routing": trainer.routing_metrics(tb)}
            if case.get("train"):
                tb["advantages"] = torch.randn(len(batch), 1).expand_as(tb["loss_mask"]) * tb["loss_mask"]
                trainer.update_controller(tb)
                res["metrics"] = trainer.train_step(tb)
        finally:
            undo()
        results[case["name"]] = res
        del trainer
        parallel_state.destroy_model_parallel()
    return results


if __name__ == "__main__":
    mw.main(globals())
