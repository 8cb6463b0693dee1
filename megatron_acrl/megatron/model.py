"""Megatron-Core GPT models (dense Llama/Qwen2/Qwen3 and Qwen3-MoE) from :class:`ModelConfig`.

The architecture switches of the supported families all map onto ``TransformerConfig``: RMSNorm,
SwiGLU (``gated_linear_unit`` + SiLU), RoPE, GQA (``num_query_groups``), optional QK-norm, optional QKV
bias, tied or untied embeddings; for MoE a softmax top-k router (Qwen3-MoE renormalises the top-k
probabilities, which equals Megatron's softmax over the top-k logits), optional shared expert and the
load-balancing auxiliary loss.

Layer specs: Transformer-Engine specs when a CUDA device is present and ``transformer_engine``
imports, Megatron's local (pure torch) specs otherwise. Parameter names differ between the two
(``linear_qkv.layer_norm_weight`` vs ``input_layernorm.weight``);
``megatron_acrl.megatron.convert`` normalises them in one place.
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_acrl.config import ModelConfig, ParallelConfig
from megatron_acrl.megatron import cpu_compat

__all__ = [
    "build_model_chunks",
    "layer_spec",
    "padded_vocab_size",
    "transformer_config",
    "unwrap",
    "use_transformer_engine",
]


def use_transformer_engine() -> bool:
    """Transformer-Engine specs need both a CUDA device and an importable transformer_engine."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Vocab rows allocated in Megatron: a multiple of ``lcm(divisible_by, tp)``.

    Not Megatron-LM's ``divisible_by * tp``: that makes the embedding's global shape depend on TP,
    and a distributed checkpoint could then not be loaded under another TP size (the global shapes
    of the embedding, output layer and their optimizer state must match). With the lcm the padding
    is the same for every TP that divides ``divisible_by`` (1, 2, 4, 8, ...), and still a multiple
    of TP. The padded rows are never targets; the fused log-prob masks their logits to -inf so the
    distribution equals the HF/SGLang one over ``vocab_size`` entries, whatever the TP size.
    """
    multiple = math.lcm(divisible_by, tp)
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config(
    model: ModelConfig, parallel: ParallelConfig, *, recompute: str = "none"
) -> TransformerConfig:
    """Megatron ``TransformerConfig`` for ``model`` under ``parallel``.

    Loss scaling is owned by ``loss_adapter`` (``calculate_per_token_loss`` stays False there; see it).
    ``recompute="full"`` checkpoints every transformer layer (``training.activation_recompute``).
    """
    bf16 = model.params_dtype == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    on_cpu = not torch.cuda.is_available()
    kwargs: dict = {}
    if model.is_moe:
        kwargs.update(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=model.moe_shared_expert_ffn_hidden_size or None,
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
            moe_router_score_function="softmax",
            # topk-then-softmax == softmax-then-topk-then-renormalise (Qwen3-MoE norm_topk_prob=True)
            moe_router_pre_softmax=False,
            moe_token_dispatcher_type="alltoall",
            # Grouped GEMM needs TE (or the grouped_gemm CUDA package); SequentialMLP elsewhere.
            moe_grouped_gemm=use_transformer_engine(),
            # Router in fp32 so routing decisions do not flip with the activation dtype.
            moe_router_dtype="fp32",
            # Routers get a RouterReplay: the policy drives it for routing replay (R3/R2) and to
            # observe its own routing (routing_replay.py); without an action it routes as usual.
            moe_enable_routing_replay=True,
        )
    if recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        # RL post-training runs without dropout, so the trainer's pi matches the rollout policy.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=bf16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        expert_model_parallel_size=parallel.ep,
        sequence_parallel=parallel.sequence_parallel,
        use_cpu_initialization=on_cpu,
        # gloo: batched isend/irecv in the interleaved schedule silently swaps activations and
        # grads between virtual stages (measured); separate send/recv pairs are exact.
        batch_p2p_comm=not on_cpu,
        masked_softmax_fusion=not on_cpu,
        **kwargs,
    )


def layer_spec(model: ModelConfig, use_te: bool | None = None) -> ModuleSpec:
    """Decoder layer spec: TE on GPU (when installed), Megatron-local otherwise."""
    use_te = use_transformer_engine() if use_te is None else use_te
    num_experts = model.num_experts or None
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=bool(num_experts), qk_layernorm=model.qk_layernorm
        )
    return get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=model.qk_layernorm,
        normalization="RMSNorm",
    )


def build_model_chunks(
    model: ModelConfig,
    parallel: ParallelConfig,
    config: TransformerConfig,
    pg_collection: ProcessGroupCollection,
) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), bf16-wrapped where configured.

    Not yet DDP-wrapped (the trainer does that; a reference model stays unwrapped). Parameters are
    randomly initialised with Megatron's init (``training.seed`` via the RNG tracker); load real
    weights with ``Policy.load_hf``. On a host without CUDA, :func:`cpu_compat.apply` must have run
    (RuntimeError naming it otherwise).
    """
    cpu_compat.require()
    pp_rank = pg_collection.pp.rank()
    pp_size = pg_collection.pp.size()
    vpp = parallel.vpp or 1
    spec = layer_spec(model)
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(vpp):
        first = pp_rank == 0 and vp_stage == 0
        last = pp_rank == pp_size - 1 and vp_stage == vpp - 1
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(model.vocab_size, parallel.tp),
            max_sequence_length=model.max_position_embeddings,
            pre_process=first,
            post_process=last,
            parallel_output=True,  # logits stay vocab-parallel: the fused log-prob reduces over TP
            share_embeddings_and_output_weights=model.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(model.rotary_base),
            pg_collection=pg_collection,
            vp_stage=vp_stage if parallel.vpp else None,
        )
        gpt.model_type = ModelType.encoder_or_decoder
        chunks.append(Float16Module(config, gpt) if config.bf16 else gpt)
    return chunks


def unwrap(module: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not isinstance(module, GPTModel):
        module = module.module
    return module
