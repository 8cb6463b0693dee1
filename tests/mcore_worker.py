"""Scenarios run on gloo ranks by ``tests/dist_launch.py`` (real megatron-core, CPU patches).

    python tests/mcore_worker.py <scenario> '<json args>' <out_dir>     (RANK/WORLD_SIZE/MASTER_* set)

Each scenario writes ``<out_dir>/rank_<r>.pt``.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron_acrl.config import config_from_dict, config_to_dict  # noqa: E402
from megatron_acrl.megatron import cpu_compat  # noqa: E402
from megatron_acrl.megatron.logprobs import vocab_parallel_logprobs  # noqa: E402

SEED = 1234
N_SEQ, SEQ_LEN, MBS = 8, 16, 2

# Qwen3-MoE: 4 experts top-2, aux loss.
_MOE: dict[str, Any] = dict(
    family="qwen3_moe",
    tie_embeddings=False,
    add_qkv_bias=False,
    qk_layernorm=True,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_aux_loss_coeff=0.01,
)

MODELS: dict[str, dict[str, Any]] = {
    # Qwen2-style: QKV bias, tied embeddings.
    "qwen2": dict(family="qwen2", tie_embeddings=True, add_qkv_bias=True),
    # Qwen3-style: QK-norm, no bias, untied, explicit head_dim; with a KL-to-reference term.
    "qwen3": dict(
        family="qwen3", tie_embeddings=False, add_qkv_bias=False, qk_layernorm=True, kv_channels=32
    ),
    # Qwen3-MoE: 4 experts top-2, aux loss.
    "moe": _MOE,
    # ... plus a shared expert (Megatron-only semantics: HF Qwen3-MoE has none).
    "moe_shared": dict(_MOE, moe_shared_expert_ffn_hidden_size=32),
    # ... without the aux loss, which Megatron computes per micro-batch (over its padding too), so it
    # changes with the micro-batch cut by definition; the RL loss does not.
    "moe_noaux": dict(_MOE, moe_aux_loss_coeff=0.0),
}
HF_PARITY = ("qwen2", "qwen3", "moe")


def make_config(kind: str, layout: dict[str, Any], bf16: bool = False, micro_batch_size: int = MBS):
    model = dict(
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=320,
        max_position_embeddings=128,
        params_dtype="bf16" if bf16 else "fp32",
        **MODELS[kind],
    )
    parallel = {
        k: v
        for k, v in layout.items()
        if k in ("tp", "pp", "vpp", "ep", "sequence_parallel", "distributed_optimizer")
    }
    budgets = {  # token-budget micro-batches (the layout's "budget" / "logprob_budget")
        key: layout[short] for short, key in _BUDGETS.items() if layout.get(short) is not None
    }
    return config_from_dict(
        {
            "model": model,
            "parallel": parallel,
            "rollout": {"temperature": 0.8, "max_new_tokens": 12, "max_prompt_len": 8},
            # First Adam step with eps >> |g|: update = -lr * g / (|g| + eps) ~= -g, a strictly monotone
            # function of the gradient (and the distributed optimizer supports only Adam). No clipping.
            "training": {
                "lr": 1e3,
                "adam_eps": 1e3,
                "grad_clip": 1e6,
                "weight_decay": 0.0,
                "micro_batch_size": micro_batch_size,
                "logprob_chunk_size": 5,
                "seed": SEED,
                **budgets,
            },
            "algorithm": {
                "entropy_coef": 0.01,
                "kl_coef": 0.05 if kind == "qwen3" else 0.0,
                "loss_agg": layout.get("agg", "seq-mean-token-mean"),
            },
            # qwen2 also normalises the weights by the batch's mean weight (batch_normalize): one mean
            # for every micro-batch and rank, which its one-micro-batch reference checks (run_case)
            "correction": {"method": "acrl", "gamma": 0.65, "batch_normalize": kind == "qwen2"},
        }
    )


_BUDGETS = {"budget": "max_tokens_per_microbatch", "logprob_budget": "max_tokens_per_logprob_microbatch"}
VARLEN_ENDS = (16, 5, 9, 16, 6, 12, 7, 14)
"""Sequence ends of the long-tailed batch (``varlen``) the token-budget layouts are tested on."""


def make_batch(vocab: int, varlen: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, vocab, (N_SEQ, SEQ_LEN), generator=g)
    mask = torch.zeros(N_SEQ, SEQ_LEN)
    for i in range(N_SEQ):
        prompt = 3 + i % 3
        end = VARLEN_ENDS[i] if varlen else SEQ_LEN - (i % 4)  # right padding of 0..3 tokens
        mask[i, prompt:end] = 1
        tokens[i, end:] = 0
    adv = torch.randn(N_SEQ, 1, generator=g).expand(-1, SEQ_LEN) * mask
    noise = torch.randn(N_SEQ, SEQ_LEN, generator=g)
    return {"tokens": tokens, "loss_mask": mask, "advantages": adv.contiguous(), "noise": noise}


def run_case(
    kind: str,
    layout: dict[str, Any],
    init: dict[str, torch.Tensor] | None,
    negative: bool = False,
    checkpoint_dir: str | None = None,
    hf_dir: str | None = None,
    bf16: bool = False,
) -> dict[str, Any]:
    """One layout: forward-only log-probs, two controller updates, one optimizer step, export."""
    from megatron_acrl.megatron import convert
    from megatron_acrl.megatron.base import initialize_parallel
    from megatron_acrl.megatron.policy import Policy

    t0 = time.perf_counter()
    # qwen2's single-rank reference trains the batch as one micro-batch: with batch_normalize, a
    # per-micro-batch mean in the layouts (micro-batches of MBS) would not match it
    whole = init is None and kind == "qwen2"
    cfg = make_config(kind, layout, bf16=bf16, micro_batch_size=N_SEQ if whole else MBS)
    initialize_parallel(cfg.parallel, SEED)
    original_shard = convert.tp_shard
    if negative:  # wrongly sharded weights: every TP rank loads its mirror rank's shard
        convert.tp_shard = lambda name, full, n, r, dim: original_shard(name, full, n, n - 1 - r, dim)
    try:
        trainer = Policy(cfg)
        if init is not None:
            trainer.load_hf(init)
    finally:
        convert.tp_shard = original_shard
    out: dict[str, Any] = {}
    if init is None:
        out["init"] = {k: v.detach().clone() for k, v in trainer.hf_weights(all_stages=True)}
    batch = make_batch(cfg.model.vocab_size, varlen=layout.get("varlen", False))
    mask = batch["loss_mask"]
    if hf_dir is not None:  # the same (initial) weights in HF transformers give the same log-probs
        trainer.save_hf(hf_dir)
        out["hf_old"] = hf_logprobs(hf_dir, batch["tokens"], cfg.rollout.temperature) * mask
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
        entropy=lp["entropy"] * mask,
        metrics=metrics,
        controller=trainer.controller.state_dict(),
        after={k: v.detach().clone() for k, v in trainer.hf_weights(all_stages=True)},
    )
    out["stage_names"] = [name for name, _ in trainer.hf_weights()]  # per-stage mode (weight sync)
    if checkpoint_dir is not None:  # resume reproduces the next step exactly
        trainer.save_checkpoint(checkpoint_dir)
        m2 = trainer.train_step(second)
        trainer.load_checkpoint(checkpoint_dir)
        m2_again = trainer.train_step(second)
        out["resume"] = (m2, m2_again)
    out["seconds"] = time.perf_counter() - t0
    del trainer
    parallel_state.destroy_model_parallel()
    return out


def run_critic_case(
    kind: str,
    layout: dict[str, Any],
    init: dict[str, torch.Tensor] | None,
    negative: bool = False,
    checkpoint_dir: str | None = None,
) -> dict[str, Any]:
    """One layout of the PPO critic: forward-only values, one clipped value-loss step, export."""
    from megatron_acrl.megatron import critic as critic_mod
    from megatron_acrl.megatron.base import initialize_parallel

    t0 = time.perf_counter()
    cfg = make_config(kind, layout)
    initialize_parallel(cfg.parallel, SEED)
    critic = critic_mod.Critic(cfg)
    out: dict[str, Any] = {}
    if init is None:
        out["init"] = {k: v.detach().clone() for k, v in critic.hf_weights(all_stages=True)}
    else:
        critic.load_hf(init)
    batch = make_batch(cfg.model.vocab_size, varlen=layout.get("varlen", False))
    mask = batch["loss_mask"]
    values = critic.forward_values(batch)["values"]
    g = torch.Generator().manual_seed(9)
    # "Old" values off by exactly 0 or +-0.5 (> value_clip): the clipped branch is active on about a
    # quarter of the tokens, and no token sits at a rounding-level tie between the two branches
    # (V_old + (V - V_old) != V in floating point), which would make the clip fraction layout-noise.
    noise = batch["noise"]
    delta = torch.where(noise.abs() > 0.7, 0.5 * noise.sign(), torch.zeros_like(noise))
    batch["values"] = (values + delta) * mask
    batch["returns"] = torch.randn(values.shape, generator=g) * mask
    original_gather = critic_mod.gather_from_sequence_parallel_region
    if negative:  # the tempting bug: reduce-scatter the (already full) input gradient under SP
        critic_mod.gather_from_sequence_parallel_region = lambda x, tensor_parallel_output_grad, group: (
            original_gather(x, tensor_parallel_output_grad=True, group=group)
        )
    try:
        metrics = critic.train_step(batch)
    finally:
        critic_mod.gather_from_sequence_parallel_region = original_gather
    out.update(
        values=values * mask,
        metrics=metrics,
        after={k: v.detach().clone() for k, v in critic.hf_weights(all_stages=True)},
    )
    if checkpoint_dir is not None:  # resume reproduces the next step exactly
        critic.save_checkpoint(checkpoint_dir)
        m2 = critic.train_step(batch)
        critic.load_checkpoint(checkpoint_dir, step=1)
        m2_again = critic.train_step(batch)
        out["resume"] = (m2, m2_again)
    out["seconds"] = time.perf_counter() - t0
    del critic
    parallel_state.destroy_model_parallel()
    return out


def hf_logprobs(hf_dir: str, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Aligned log-probs of ``tokens`` from HF transformers loading our exported checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(tokens.shape[0], 1), lp], 1)


def scenario_reference(args: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for kind in args["kinds"]:
        hf_dir = str(Path(args["tmp"]) / f"hf_{kind}") if kind in HF_PARITY else None
        out[kind] = run_case(kind, {}, None, hf_dir=hf_dir)
    for kind in args.get("critic_kinds", []):
        out[f"critic_{kind}"] = run_critic_case(kind, {}, None)
    for name, ref in args.get("varlen", {}).items():  # fixed micro-batches on the long-tailed batch
        run = run_critic_case if ref.get("critic") else run_case
        out[name] = run(ref["kind"], dict(varlen=True, agg=ref.get("agg", "seq-mean-token-mean")), None)
    return out


def scenario_layouts(args: dict[str, Any]) -> dict[str, Any]:
    ref = torch.load(args["reference"], weights_only=False)
    results = {}
    for case in args["cases"]:
        if case.get("critic"):
            results[case["name"]] = run_critic_case(
                case["kind"],
                case["layout"],
                ref[case.get("ref", f"critic_{case['kind']}")]["init"],
                negative=case.get("negative", False),
                checkpoint_dir=case.get("checkpoint_dir"),
            )
            continue
        res = run_case(
            case["kind"],
            case["layout"],
            ref[case.get("ref", case["kind"])]["init"],
            negative=case.get("negative", False),
            checkpoint_dir=case.get("checkpoint_dir"),
            bf16=case.get("bf16", False),
        )
        results[case["name"]] = res
    return results


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.hf_weights(all_stages=True)}


def _prepared_batches(trainer: Any) -> tuple[dict, dict]:
    """Two controller observations and the training batch of ``run_case`` (on every rank)."""
    batch = make_batch(trainer.cfg.model.vocab_size)
    mask = batch["loss_mask"]
    batch["old_logprobs"] = trainer.forward_logprobs(batch)["logprobs"] * mask
    if trainer.ref_model is not None:
        batch["ref_logprobs"] = trainer.forward_logprobs(batch, reference=True)["logprobs"] * mask
    first = dict(batch, rollout_logprobs=(batch["old_logprobs"] + 0.02 * batch["noise"]) * mask)
    second = dict(batch, rollout_logprobs=(batch["old_logprobs"] + 0.05 * batch["noise"]) * mask)
    return first, second


def _try_load(cfg: Any, ckpt: str | Path) -> str:
    """Load ``ckpt`` into a fresh Policy of ``cfg``: 'loaded', or the ConfigError's message."""
    from megatron_acrl.config import ConfigError
    from megatron_acrl.megatron.base import initialize_parallel
    from megatron_acrl.megatron.policy import Policy

    initialize_parallel(cfg.parallel, SEED)
    model = Policy(cfg)
    try:
        model.load_checkpoint(ckpt)
        return "loaded"
    except ConfigError as e:
        return str(e)
    finally:
        del model
        parallel_state.destroy_model_parallel()


def scenario_checkpoints(args: dict[str, Any]) -> dict[str, Any]:
    """Distributed checkpoints: save under one layout, load under others (identical full weights,
    the optimizer state resharded: the next step matches), a crash inside a save leaves the last
    good checkpoint, and a checkpoint of another model is refused with the mismatched fields."""
    from megatron_acrl.megatron import checkpoint as checkpoint_mod
    from megatron_acrl.megatron.base import initialize_parallel
    from megatron_acrl.megatron.critic import Critic
    from megatron_acrl.megatron.policy import Policy

    root = Path(args["tmp"])
    out: dict[str, Any] = {}
    for group in args["groups"]:
        kind, ckpt = group["kind"], str(root / group["name"])
        save_layout = group["save"]
        cfg = make_config(kind, save_layout)
        initialize_parallel(cfg.parallel, SEED)
        critic = group.get("critic", False)
        model = Critic(cfg) if critic else Policy(cfg)
        res: dict[str, Any] = {}
        if critic:
            batch = make_batch(cfg.model.vocab_size)
            mask = batch["loss_mask"]
            batch["values"] = model.forward_values(batch)["values"] * mask
            batch["returns"] = batch["noise"] * mask
            second = batch
        else:
            first, second = _prepared_batches(model)
            model.update_controller(first)
            model.update_controller(second)
        model.train_step(second)  # step 1: the optimizer has state
        model.save_checkpoint(ckpt)
        res["saved"] = _weights(model)
        res["m2"] = model.train_step(second)
        res["after2"] = _weights(model)
        if group.get("crash"):  # a save of step 2 that dies after writing its shards
            original = checkpoint_mod.dist_checkpointing.save

            def crashing(*a: Any, _save: Any = original, **k: Any) -> None:
                _save(*a, **k)
                raise RuntimeError("simulated crash mid-save")

            checkpoint_mod.dist_checkpointing.save = crashing
            try:
                model.save_checkpoint(ckpt)
            except RuntimeError as e:
                res["crash"] = str(e)
            finally:
                checkpoint_mod.dist_checkpointing.save = original
            res["latest_after_crash"] = json.loads((Path(ckpt) / "latest.json").read_text())
            res["dirs_after_crash"] = sorted(p.name for p in Path(ckpt).iterdir())
            model.load_checkpoint(ckpt)  # the last good one: step 1
            res["resumed_step"] = model.step
            res["m2_after_crash"] = model.train_step(second)
            res["after2_after_crash"] = _weights(model)
        del model
        parallel_state.destroy_model_parallel()

        loads = {}
        for i, layout in enumerate(group["load"]):
            cfg = make_config(kind, layout)
            initialize_parallel(cfg.parallel, SEED)
            model = Critic(cfg) if critic else Policy(cfg)
            model.load_checkpoint(ckpt)
            got: dict[str, Any] = {"step": model.step, "loaded": _weights(model)}
            if not critic:
                got["controller"] = model.controller.state_dict()
            got["m2"] = model.train_step(second)
            got["after2"] = _weights(model)
            loads[i] = got
            del model
            parallel_state.destroy_model_parallel()
        res["loads"] = loads

        for i, change in enumerate(group.get("mismatch", [])):  # another model: a clear error
            data = config_to_dict(make_config(kind, {}))
            data["model"].update(change)
            res[f"mismatch{i}"] = _try_load(config_from_dict(data), ckpt)
        for i, layout in enumerate(group.get("refuse", [])):  # layouts that cannot take its optimizer
            res[f"refused{i}"] = _try_load(make_config(kind, layout), ckpt)
        out[group["name"]] = res
    return out


def scenario_logprobs(args: dict[str, Any]) -> dict[str, Any]:
    """Fused vocab-parallel log-prob/entropy vs a float64 full softmax, values and gradients."""
    tp = dist.get_world_size()
    rank = dist.get_rank()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for vocab, padded, temperature, chunk in ((50, 64, 1.0, 7), (61, 64, 0.7, 1000), (64, 64, 1.3, 3)):
            g = torch.Generator().manual_seed(11)
            logits = (torch.randn(3, 9, padded, generator=g) * 4).to(dtype)
            target = torch.randint(0, vocab, (3, 9), generator=g)
            g_lp = torch.randn(3, 9, generator=g)
            g_ent = torch.randn(3, 9, generator=g)
            shard = logits.chunk(tp, dim=-1)[rank].clone().requires_grad_(True)
            lp, ent = vocab_parallel_logprobs(
                shard,
                target,
                tp_group=dist.group.WORLD,
                vocab_size=vocab,
                temperature=temperature,
                chunk_size=chunk,
                with_entropy=True,
            )
            (lp * g_lp + ent * g_ent).sum().backward()
            grads = [torch.empty_like(shard.grad) for _ in range(tp)]
            dist.all_gather(grads, shard.grad)
            full_grad = torch.cat(grads, -1).double()
            ref_logits = logits.double()[..., :vocab].clone().requires_grad_(True)
            logp_all = torch.log_softmax(ref_logits / temperature, -1)
            ref_lp = logp_all.gather(-1, target[..., None]).squeeze(-1)
            ref_ent = -(logp_all.exp() * logp_all).sum(-1)
            (ref_lp * g_lp + ref_ent * g_ent).sum().backward()
            key = f"{str(dtype).split('.')[-1]}_v{vocab}_t{temperature}_c{chunk}"
            out[key] = {
                "lp_err": (lp.double() - ref_lp).abs().max().item(),
                "ent_err": (ent.double() - ref_ent).abs().max().item(),
                "grad_err": (full_grad[..., :vocab] - ref_logits.grad).abs().max().item(),
                "pad_grad": full_grad[..., vocab:].abs().max().item() if padded > vocab else 0.0,
                "grad_scale": ref_logits.grad.abs().max().item(),
            }
    return out


def main(scenarios: dict[str, Any] | None = None) -> None:
    """Run ``scenario_<argv[1]>`` from ``scenarios`` (default: this module's) on this gloo rank."""
    scenario, args, out_dir = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo")
    cpu_compat.apply()  # this worker is an entry point that builds models
    try:
        result = (scenarios or globals())[f"scenario_{scenario}"](args)
        torch.save(result, out_dir / f"rank_{dist.get_rank()}.pt")
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
