"""Megatron-Core <-> HF name and layout tables (llama, qwen2, qwen3, qwen3_moe): one table, two directions.

Megatron names here are *canonical*: full (TP=PP=EP=1) tensors with global layer and expert indices
and local-spec names. :func:`canonical_name` maps everything else onto them in one place:
wrapper prefixes (``module.``), Transformer-Engine names (``linear_qkv.layer_norm_weight`` ->
``input_layernorm.weight``, ``linear_fc1.layer_norm_weight`` -> ``pre_mlp_layernorm.weight``) and
grouped-GEMM expert names (``experts.linear_fc1.weight3`` -> ``experts.local_experts.3.linear_fc1.weight``).

Layout rules (each applied in both directions by the same :class:`Rule`):
  * ``qkv``: Megatron fuses Q, K, V and interleaves them per query group:
    ``[g0: q(heads_per_group*d), k(d), v(d) | g1: ...]``; HF keeps ``q_proj``/``k_proj``/``v_proj``.
  * ``glu``: Megatron's ``linear_fc1`` is ``[gate; up]``; HF keeps ``gate_proj`` and ``up_proj``.
  * ``vocab``: Megatron pads the vocabulary rows for TP; HF has exactly ``vocab_size`` rows.
  * tied embeddings: no ``lm_head.weight`` on the HF side; Megatron's ``output_layer.weight`` (present
    on the last pipeline stage) is fed from ``model.embed_tokens.weight`` and never exported.
  * experts are exported one tensor per expert
    (``model.layers.L.mlp.experts.E.gate_proj.weight``): SGLang silently ignores fused expert names.

Pure functions only (no process groups); the TP split/merge helpers at the bottom are GLU-aware and
are what the trainer uses after/before its collectives.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "ArchInfo",
    "Rule",
    "canonical_name",
    "hf_config",
    "hf_names",
    "hf_sources",
    "hf_to_megatron",
    "is_glu",
    "iter_megatron_to_hf",
    "megatron_names",
    "megatron_to_hf",
    "tp_merge",
    "tp_shard",
]

Kind = Literal["copy", "qkv", "glu", "vocab"]


@dataclass(frozen=True)
class ArchInfo:
    """What the name/layout tables need to know about a model."""

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    qk_layernorm: bool
    add_qkv_bias: bool
    num_experts: int = 0
    shared_expert: bool = False

    @classmethod
    def from_model_config(cls, model) -> ArchInfo:  # noqa: ANN001 - megatron_acrl.config.ModelConfig
        """Build from ``megatron_acrl.config.ModelConfig``."""
        return cls(
            family=model.family,
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            num_attention_heads=model.num_attention_heads,
            num_query_groups=model.num_query_groups,
            head_dim=model.kv_channels or model.hidden_size // model.num_attention_heads,
            vocab_size=model.vocab_size,
            tie_embeddings=model.tie_embeddings,
            qk_layernorm=model.qk_layernorm,
            add_qkv_bias=model.add_qkv_bias,
            num_experts=model.num_experts,
            shared_expert=model.moe_shared_expert_ffn_hidden_size > 0,
        )


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the HF tensor(s) it is made of. ``{L}`` = layer, ``{E}`` = expert."""

    megatron: str
    hf: tuple[str, ...]
    kind: Kind = "copy"


def _rules(info: ArchInfo) -> list[Rule]:
    """The table for ``info``'s family: every rule that applies to this architecture."""
    if info.family not in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        raise ValueError(f"no name table for model family {info.family!r}")
    a, h = "decoder.layers.{L}.self_attention.", "model.layers.{L}.self_attn."
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
        Rule(
            "output_layer.weight",
            ("model.embed_tokens.weight",) if info.tie_embeddings else ("lm_head.weight",),
            "vocab",
        ),
        Rule("decoder.layers.{L}.input_layernorm.weight", ("model.layers.{L}.input_layernorm.weight",)),
        Rule(a + "linear_qkv.weight", (h + "q_proj.weight", h + "k_proj.weight", h + "v_proj.weight"), "qkv"),
        Rule(a + "linear_proj.weight", (h + "o_proj.weight",)),
        Rule(
            "decoder.layers.{L}.pre_mlp_layernorm.weight",
            ("model.layers.{L}.post_attention_layernorm.weight",),
        ),
    ]
    if info.add_qkv_bias:
        rules.append(
            Rule(a + "linear_qkv.bias", (h + "q_proj.bias", h + "k_proj.bias", h + "v_proj.bias"), "qkv")
        )
    if info.qk_layernorm:
        rules += [
            Rule(a + "q_layernorm.weight", (h + "q_norm.weight",)),
            Rule(a + "k_layernorm.weight", (h + "k_norm.weight",)),
        ]
    m, hm = "decoder.layers.{L}.mlp.", "model.layers.{L}.mlp."
    if info.num_experts:
        e, he = m + "experts.local_experts.{E}.", hm + "experts.{E}."
        rules += [
            Rule(m + "router.weight", (hm + "gate.weight",)),
            Rule(e + "linear_fc1.weight", (he + "gate_proj.weight", he + "up_proj.weight"), "glu"),
            Rule(e + "linear_fc2.weight", (he + "down_proj.weight",)),
        ]
        if info.shared_expert:
            s, hs = m + "shared_experts.", hm + "shared_expert."
            rules += [
                Rule(s + "linear_fc1.weight", (hs + "gate_proj.weight", hs + "up_proj.weight"), "glu"),
                Rule(s + "linear_fc2.weight", (hs + "down_proj.weight",)),
            ]
    else:
        rules += [
            Rule(m + "linear_fc1.weight", (hm + "gate_proj.weight", hm + "up_proj.weight"), "glu"),
            Rule(m + "linear_fc2.weight", (hm + "down_proj.weight",)),
        ]
    return rules


def _pattern(template: str) -> re.Pattern[str]:
    escaped = re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile("^" + escaped + "$")


def _match(name: str, info: ArchInfo) -> tuple[Rule, dict[str, str]]:
    for rule in _rules(info):
        found = _pattern(rule.megatron).match(name)
        if found:
            return rule, found.groupdict()
    raise KeyError(f"no HF mapping for Megatron parameter {name!r} (family {info.family})")


# --------------------------------------------------------------------------------------------
# Name normalisation (the one place TE / local / wrapper names meet)
# --------------------------------------------------------------------------------------------

_TE_RENAMES = (
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
)
_GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def canonical_name(name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Canonical Megatron name of a local parameter name.

    Args:
        name: as returned by ``named_parameters()`` of a (possibly DDP / Float16Module wrapped) chunk.
        layer_offset: global index of this chunk's first decoder layer (PP / VPP).
        expert_offset: global index of this rank's first local expert (EP).
    """
    while name.startswith("module."):
        name = name[len("module.") :]
    for pattern, local in _TE_RENAMES:
        name = pattern.sub(local, name)
    name = _GROUPED_EXPERT.sub(lambda m: f"mlp.experts.local_experts.{m.group(2)}.{m.group(1)}.weight", name)
    if layer_offset:
        name = re.sub(
            r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name
        )
    if expert_offset:
        name = re.sub(
            r"\.local_experts\.(\d+)\.", lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name
        )
    return name


def _fill(template: str, groups: dict[str, str]) -> str:
    return template.replace("{L}", groups.get("L") or "").replace("{E}", groups.get("E") or "")


# --------------------------------------------------------------------------------------------
# The two directions
# --------------------------------------------------------------------------------------------


def _qkv_split(t: torch.Tensor, info: ArchInfo) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[ng*(qpg+2)*d, ...] interleaved per group -> q [nh*d, ...], k [ng*d, ...], v [ng*d, ...]."""
    ng, d = info.num_query_groups, info.head_dim
    qpg = info.num_attention_heads // ng
    grouped = t.reshape(ng, (qpg + 2) * d, *t.shape[1:])
    q, k, v = torch.split(grouped, [qpg * d, d, d], dim=1)
    rest = t.shape[1:]
    return q.reshape(ng * qpg * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)


def _qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: ArchInfo) -> torch.Tensor:
    ng, d = info.num_query_groups, info.head_dim
    qpg = info.num_attention_heads // ng
    rest = q.shape[1:]
    grouped = torch.cat(
        [q.reshape(ng, qpg * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1
    )
    return grouped.reshape(ng * (qpg + 2) * d, *rest)


def megatron_to_hf(name: str, tensor: torch.Tensor, info: ArchInfo) -> list[tuple[str, torch.Tensor]]:
    """HF tensors of one full canonical Megatron tensor (empty for a tied ``output_layer.weight``).

    Args:
        name: canonical Megatron name (see :func:`canonical_name`).
        tensor: the full (TP-merged) tensor; for ``vocab`` rules ``[padded_vocab, hidden]``.
    """
    rule, groups = _match(name, info)
    if name == "output_layer.weight" and info.tie_embeddings:
        return []  # exported once, as model.embed_tokens.weight
    hf = [_fill(t, groups) for t in rule.hf]
    if rule.kind == "copy":
        return [(hf[0], tensor)]
    if rule.kind == "vocab":
        return [(hf[0], tensor[: info.vocab_size])]
    if rule.kind == "qkv":
        return list(zip(hf, _qkv_split(tensor, info), strict=True))
    gate, up = tensor.chunk(2, dim=0)
    return [(hf[0], gate), (hf[1], up)]


def hf_sources(name: str, info: ArchInfo) -> list[str]:
    """HF tensor names that make up canonical Megatron tensor ``name``."""
    rule, groups = _match(name, info)
    return [_fill(t, groups) for t in rule.hf]


def hf_to_megatron(
    name: str, get: Callable[[str], torch.Tensor], info: ArchInfo, padded_vocab: int | None = None
) -> torch.Tensor:
    """Full canonical Megatron tensor ``name`` assembled from HF tensors fetched with ``get(hf_name)``.

    ``padded_vocab`` (rows of Megatron's embedding/output) defaults to ``info.vocab_size``; padding
    rows are zero.
    """
    rule, groups = _match(name, info)
    parts = [get(_fill(t, groups)) for t in rule.hf]
    if rule.kind == "copy":
        return parts[0]
    if rule.kind == "vocab":
        rows = padded_vocab or info.vocab_size
        src = parts[0]
        if src.shape[0] > rows:
            raise ValueError(f"{rule.hf[0]} has {src.shape[0]} rows, more than the {rows} allocated")
        if src.shape[0] == rows:
            return src
        out = src.new_zeros((rows, *src.shape[1:]))
        out[: src.shape[0]] = src
        return out
    if rule.kind == "qkv":
        return _qkv_merge(*parts, info)
    return torch.cat(parts, dim=0)


def megatron_names(info: ArchInfo) -> list[str]:
    """Every canonical Megatron parameter name of the full model (output layer only if untied)."""
    names: list[str] = []
    for rule in _rules(info):
        if rule.megatron == "output_layer.weight" and info.tie_embeddings:
            continue
        layers = range(info.num_layers) if "{L}" in rule.megatron else [None]
        experts = range(info.num_experts) if "{E}" in rule.megatron else [None]
        for layer in layers:
            for expert in experts:
                names.append(
                    _fill(
                        rule.megatron,
                        {
                            "L": str(layer) if layer is not None else "",
                            "E": str(expert) if expert is not None else "",
                        },
                    )
                )
    return names


def hf_names(info: ArchInfo) -> list[str]:
    """Every HF tensor name of the model, in export order."""
    out: list[str] = []
    for name in megatron_names(info):
        out += hf_sources(name, info)
    return out


def iter_megatron_to_hf(
    tensors: Iterator[tuple[str, torch.Tensor]], info: ArchInfo
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (canonical Megatron name, full tensor) pairs into (HF name, tensor) pairs."""
    for name, tensor in tensors:
        yield from megatron_to_hf(name, tensor, info)
        del tensor  # not alive while the next one is produced


_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}


def hf_config(model) -> dict:  # noqa: ANN001 - megatron_acrl.config.ModelConfig
    """``config.json`` contents of the HF model equivalent to ``model`` (a ``ModelConfig``).

    Written next to exported safetensors so HF transformers and SGLang build the same network.
    Qwen3-MoE has no shared expert in HF; a config with one is rejected here rather than exported
    into a checkpoint HF would silently load without it.
    """
    arch, model_type = _ARCHITECTURES[model.family]
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    cfg = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": head_dim,
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.norm_epsilon,
        "rope_theta": model.rotary_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rotary_base},
        "tie_word_embeddings": model.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": model.add_qkv_bias,
        "torch_dtype": "bfloat16" if model.params_dtype == "bf16" else "float32",
    }
    if model.family == "qwen2" and not model.add_qkv_bias:
        raise ValueError("HF Qwen2 always has a QKV bias; use family llama for a bias-free model")
    if model.family in ("qwen2", "qwen3", "qwen3_moe"):
        cfg["use_sliding_window"] = False
    if model.family == "qwen3_moe":
        if model.moe_shared_expert_ffn_hidden_size:
            raise ValueError("HF Qwen3-MoE has no shared expert; set moe_shared_expert_ffn_hidden_size: 0")
        cfg.update(
            num_experts=model.num_experts,
            num_experts_per_tok=model.moe_router_topk,
            moe_intermediate_size=model.moe_ffn_hidden_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=model.moe_aux_loss_coeff,
        )
    return cfg


# --------------------------------------------------------------------------------------------
# Tensor-parallel split / merge (GLU-aware)
# --------------------------------------------------------------------------------------------


def is_glu(name: str) -> bool:
    """Whether ``name`` is a GLU ``linear_fc1`` (``[gate; up]``, each TP rank holding ``[gate_r; up_r]``)."""
    return name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias")


def tp_shard(name: str, full: torch.Tensor, tp_size: int, tp_rank: int, partition_dim: int) -> torch.Tensor:
    """This TP rank's shard of a full canonical Megatron tensor.

    Plain chunking is right for every tensor except the GLU ``linear_fc1``: each rank holds
    ``[gate_r; up_r]``, not a contiguous slice of ``[gate; up]``. Fused QKV needs nothing special
    because its interleaving is per query group and groups are what TP splits.
    """
    if tp_size == 1:
        return full
    if is_glu(name) and partition_dim == 0:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=partition_dim)[tp_rank]


def tp_merge(name: str, shards: list[torch.Tensor], partition_dim: int) -> torch.Tensor:
    """Inverse of :func:`tp_shard`: the full tensor from all TP ranks' shards (in rank order)."""
    if len(shards) == 1:
        return shards[0]
    if is_glu(name) and partition_dim == 0:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([g for g, _ in halves], 0), torch.cat([u for _, u in halves], 0)], 0)
    return torch.cat(shards, dim=partition_dim)
