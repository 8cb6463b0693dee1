"""LoRA scenarios run on gloo ranks by ``tests/dist_launch.py`` (real megatron-core, CPU patches).

    python tests/lora_worker.py <scenario> '<json args>' <out_dir>

The models, batches and Adam trick (eps >> |g|: the first update is ~ minus the gradient) are
``mcore_worker``'s. Each scenario writes ``<out_dir>/rank_<r>.pt``.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from mcore_worker import SEED, hf_logprobs, main, make_batch, make_config  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron_acrl.config import ConfigError, config_from_dict, config_to_dict  # noqa: E402

LORA = dict(rank=8, alpha=16.0, sync="merged")
# MoE: every target (the experts' too), merged sync (CPU SGLang cannot serve expert adapters)
KIND_LORA = {"qwen2": LORA, "qwen3": dict(LORA, sync="adapter"), "moe": LORA}


def lora_config(kind: str, layout: dict[str, Any], lora: dict[str, Any] | None = None, **model: Any) -> Any:
    """``mcore_worker.make_config`` with ``model.lora`` (None: the kind's adapters)."""
    data = config_to_dict(make_config(kind, layout))
    data["model"].update(model, lora=KIND_LORA[kind] if lora is None else lora)
    return config_from_dict(data)


def random_adapters(trainer: Any, seed: int = 5) -> dict[str, torch.Tensor]:
    """Full PEFT adapter tensors with a non-zero B (A shared by fused parts), the same in every layout."""
    state = trainer.adapter_state(dst=None)
    g = torch.Generator().manual_seed(seed)
    out, a_of = {}, {}
    for name in sorted(state):
        t = state[name]
        if ".lora_A." in name:  # one A per fused Megatron layer: q/k/v share it, gate/up share it
            fused = re.sub(r"\.(q|k|v)_proj\.", ".qkv.", name)
            fused = re.sub(r"\.(gate|up)_proj\.", ".gate_up.", fused)
            if fused not in a_of:
                a_of[fused] = torch.randn(t.shape, generator=g) * 0.2
            out[name] = a_of[fused].clone()
        else:
            out[name] = torch.randn(t.shape, generator=g) * 0.2
    return out


def _base(trainer: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.hf_weights(all_stages=True, merged=False)}


def run_lora_case(
    kind: str,
    layout: dict[str, Any],
    init: dict[str, torch.Tensor] | None,
    adapters: dict[str, torch.Tensor] | None,
    checkpoint_dir: str | None = None,
) -> dict[str, Any]:
    """One layout: log-probs with the adapters, two controller updates, one Adam step; the adapters
    after it (gathered), the base (must not move), and optionally a save / resume."""
    from megatron_acrl.megatron.base import initialize_parallel
    from megatron_acrl.megatron.policy import Policy

    cfg = lora_config(kind, layout)
    initialize_parallel(cfg.parallel, SEED)
    trainer = Policy(cfg)
    out: dict[str, Any] = {}
    if init is None:
        init = out["init"] = _base(trainer)
        adapters = out["adapters"] = random_adapters(trainer)
    else:
        trainer.load_hf(init)
    assert adapters is not None
    trainer.load_adapter_state(adapters)
    out["frozen"] = _frozen_report(trainer)
    batch = make_batch(cfg.model.vocab_size)
    mask = batch["loss_mask"]
    lp = trainer.forward_logprobs(batch, with_entropy=True)
    batch["old_logprobs"] = lp["logprobs"] * mask
    if trainer.ref_model is not None:
        batch["ref_logprobs"] = trainer.forward_logprobs(batch, reference=True)["logprobs"] * mask
    first = dict(batch, rollout_logprobs=(batch["old_logprobs"] + 0.02 * batch["noise"]) * mask)
    second = dict(batch, rollout_logprobs=(batch["old_logprobs"] + 0.05 * batch["noise"]) * mask)
    trainer.update_controller(first)
    trainer.update_controller(second)
    metrics = trainer.train_step(second)
    out.update(
        old=lp["logprobs"] * mask,
        metrics=metrics,
        adapters_after=trainer.adapter_state(dst=None),
        base_moved=max((v - init[k]).abs().max().item() for k, v in _base(trainer).items()),
    )
    if trainer.ref_model is not None:  # the KL reference is the base model, whatever the adapters
        out["ref"] = batch["ref_logprobs"]
    if checkpoint_dir is not None:
        trainer.save_checkpoint(checkpoint_dir)
        m2 = trainer.train_step(second)
        after2 = trainer.adapter_state(dst=None)
        trainer.load_checkpoint(checkpoint_dir)
        out["resume"] = (m2, trainer.train_step(second), after2, trainer.adapter_state(dst=None))
        out["ckpt_keys"] = _checkpoint_keys(Path(checkpoint_dir))
        out["merged_names"] = sorted(n for n, _ in trainer.hf_weights(all_stages=True))
        del trainer
        parallel_state.destroy_model_parallel()
        out["refusals"] = _refusals(kind, layout, init, adapters, checkpoint_dir)
        return out
    del trainer
    parallel_state.destroy_model_parallel()
    return out


def _frozen_report(trainer: Any) -> dict[str, Any]:
    """Which parameters train, and which the optimizer holds (the adapters only, by identity)."""
    from megatron_acrl.megatron import lora
    from megatron_acrl.megatron.model import unwrap

    named = [(n, p) for c in trainer.model for n, p in unwrap(c).named_parameters()]
    trainable = {n for n, p in named if p.requires_grad}
    opt_ids = set()
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        groups = getattr(opt, "float16_groups", None) or [g["params"] for g in opt.param_groups]
        if getattr(opt, "model_float16_groups", None):
            groups = opt.model_float16_groups + opt.model_fp32_groups
        for group in groups:
            opt_ids |= {id(p) for p in group}
    model_ids = {id(p): n for n, p in named}
    in_opt = {model_ids[i] for i in opt_ids if i in model_ids}
    return {
        "trainable_not_lora": sorted(n for n in trainable if not lora.is_lora_param(n)),
        "lora_not_trainable": sorted(n for n, _ in named if lora.is_lora_param(n) and n not in trainable),
        "optimizer_not_lora": sorted(n for n in in_opt if not lora.is_lora_param(n)),
        "optimizer_count": len(opt_ids),
        "lora_count": sum(1 for n, _ in named if lora.is_lora_param(n)),
    }


def _checkpoint_keys(root: Path) -> list[str]:
    from megatron.core import dist_checkpointing

    step_dir = sorted(root.glob("step_*"))[-1] / "policy"
    return sorted(dist_checkpointing.load_tensors_metadata(str(step_dir)).keys())


def _refusals(kind: str, layout: dict, init: dict, adapters: dict, ckpt: str) -> dict[str, str]:
    """Load the LoRA checkpoint with another rank, another base, and as a full model: each refused."""
    from megatron_acrl.megatron.base import initialize_parallel
    from megatron_acrl.megatron.policy import Policy

    other_base = {k: v + 0.01 if v.dim() == 2 else v for k, v in init.items()}
    tries = {
        "rank": (lora_config(kind, layout, dict(KIND_LORA[kind], rank=4)), init),
        "base": (lora_config(kind, layout), other_base),
        "full": (_full_config(kind, layout), init),
        "same": (lora_config(kind, layout), init),
    }
    out = {}
    for name, (cfg, weights) in tries.items():
        initialize_parallel(cfg.parallel, SEED)
        model = Policy(cfg)
        model.load_hf(weights)
        try:
            model.load_checkpoint(ckpt)
            out[name] = "loaded"
        except ConfigError as e:
            out[name] = str(e)
        del model
        parallel_state.destroy_model_parallel()
    return out


def _full_config(kind: str, layout: dict) -> Any:
    data = config_to_dict(make_config(kind, layout))
    data["model"]["lora"] = None
    return config_from_dict(data)


def scenario_reference(args: dict[str, Any]) -> dict[str, Any]:
    """Single-rank references, step 0 == base, the PEFT round trip and the merged oracle."""
    out = {}
    tmp = Path(args["tmp"])
    for kind in args["kinds"]:
        res = run_lora_case(kind, {}, None, None)
        res["step0"] = _step0(kind, res["init"])
        if kind in args.get("peft", []):
            res["peft"] = _peft_round_trip(kind, res["init"], res["adapters"], tmp / kind)
        out[kind] = res
    return out


def _step0(kind: str, init: dict[str, torch.Tensor]) -> float:
    """max |logp(LoRA policy, fresh adapters) - logp(no LoRA)| on the same base: must be exactly 0."""
    from megatron_acrl.megatron.base import initialize_parallel
    from megatron_acrl.megatron.policy import Policy

    lps = []
    for cfg in (lora_config(kind, {}), _full_config(kind, {})):
        initialize_parallel(cfg.parallel, SEED)
        model = Policy(cfg)
        model.load_hf(init)
        lps.append(model.forward_logprobs(make_batch(cfg.model.vocab_size))["logprobs"])
        del model
        parallel_state.destroy_model_parallel()
    return (lps[0] - lps[1]).abs().max().item()


def _peft_round_trip(kind: str, init: dict, adapters: dict, tmp: Path) -> dict[str, float]:
    """Export the trained adapters as a PEFT dir and the base as an HF dir; PEFT + transformers and
    the merged export must give the trainer's log-probs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_acrl.megatron import lora
    from megatron_acrl.megatron.base import initialize_parallel
    from megatron_acrl.megatron.policy import Policy

    cfg = lora_config(kind, {})
    initialize_parallel(cfg.parallel, SEED)
    model = Policy(cfg)
    model.load_hf(init)
    model.load_adapter_state(adapters)
    batch = make_batch(cfg.model.vocab_size)
    mask = batch["loss_mask"]
    temp = cfg.rollout.temperature
    mine = model.forward_logprobs(batch)["logprobs"] * mask
    base_dir, adapter_dir, merged_dir = tmp / "base", tmp / "adapter", tmp / "merged"
    model.save_hf(base_dir, merged=False)
    model.save_hf(merged_dir)  # merged by default
    lora.write_peft_dir(model.adapter_state(), lora.peft_adapter_config(cfg, str(base_dir)), adapter_dir)
    del model
    parallel_state.destroy_model_parallel()
    hf = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(hf, str(adapter_dir)).eval()
    with torch.no_grad():
        logits = peft_model(input_ids=batch["tokens"]).logits.float() / temp
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["tokens"][:, 1:, None]).squeeze(-1)
    peft_lp = torch.cat([torch.zeros(lp.shape[0], 1), lp], 1) * mask
    base_lp = hf_logprobs(str(base_dir), batch["tokens"], temp) * mask
    merged_lp = hf_logprobs(str(merged_dir), batch["tokens"], temp) * mask
    return {
        "peft_err": (peft_lp - mine).abs().max().item(),
        "merged_err": (merged_lp - mine).abs().max().item(),
        "adapter_effect": (base_lp - mine).abs().max().item(),
    }


def scenario_layouts(args: dict[str, Any]) -> dict[str, Any]:
    ref = torch.load(args["reference"], weights_only=False)
    out = {}
    for case in args["cases"]:
        r = ref[case["kind"]]
        out[case["name"]] = run_lora_case(
            case["kind"], case["layout"], r["init"], r["adapters"], case.get("checkpoint_dir")
        )
    return out


def scenario_optimizer_bytes(args: dict[str, Any]) -> dict[str, Any]:
    """Optimizer-state bytes (Adam moments + fp32 main params) after one step, LoRA vs full, bf16."""
    from megatron_acrl.megatron.base import initialize_parallel
    from megatron_acrl.megatron.policy import Policy

    size = dict(
        num_layers=4, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8, num_query_groups=4
    )
    out = {}
    for name, lo in (("full", None), ("lora", dict(rank=16, alpha=32.0))):
        data = config_to_dict(make_config("qwen2", {}, bf16=True))
        data["model"].update(size, lora=lo)
        cfg = config_from_dict(data)
        initialize_parallel(cfg.parallel, SEED)
        model = Policy(cfg)
        first, second = _batches(model)
        model.update_controller(second)  # ACRL observes a batch before its first step
        model.train_step(second)
        out[name] = _optimizer_bytes(model.optimizer)
        out[name + "_params"] = sum(p.numel() for c in model.model for p in c.parameters())
        del model
        parallel_state.destroy_model_parallel()
    return out


def _batches(model: Any) -> tuple[dict, dict]:
    batch = make_batch(model.cfg.model.vocab_size)
    mask = batch["loss_mask"]
    batch["old_logprobs"] = model.forward_logprobs(batch)["logprobs"] * mask
    second = dict(batch, rollout_logprobs=(batch["old_logprobs"] + 0.05 * batch["noise"]) * mask)
    return batch, second


def _optimizer_bytes(optimizer: Any) -> int:
    """Bytes of every tensor the optimizer keeps: Adam moments and the fp32 main copies."""
    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            for v in state.values():
                add(v)
        for group in getattr(opt, "fp32_from_float16_groups", []) or []:
            for p in group:
                add(p)
    return total


if __name__ == "__main__":
    main(globals())
