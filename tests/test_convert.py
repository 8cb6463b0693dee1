"""Megatron <-> HF name/layout tables (pure functions; no Megatron import)."""

from __future__ import annotations

import pytest
import torch

from megatron_acrl.config import ModelConfig
from megatron_acrl.megatron import convert

FAMILIES = {
    "llama": ModelConfig(family="llama", add_qkv_bias=False, tie_embeddings=False, num_layers=2),
    "qwen2": ModelConfig(family="qwen2", add_qkv_bias=True, tie_embeddings=True, num_layers=2),
    "qwen3": ModelConfig(family="qwen3", add_qkv_bias=False, qk_layernorm=True, kv_channels=24, num_layers=2),
    "qwen3_moe": ModelConfig(
        family="qwen3_moe",
        add_qkv_bias=False,
        qk_layernorm=True,
        num_experts=4,
        tie_embeddings=False,
        num_layers=2,
    ),
    "qwen3_moe_shared": ModelConfig(
        family="qwen3_moe",
        add_qkv_bias=False,
        num_experts=4,
        num_layers=2,
        moe_shared_expert_ffn_hidden_size=48,
    ),
}


def _hf_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of every HF tensor, written out independently of the tables under test."""
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    h, nh, ng = m.hidden_size, m.num_attention_heads, m.num_query_groups
    shapes = {"model.embed_tokens.weight": (m.vocab_size, h), "model.norm.weight": (h,)}
    if not m.tie_embeddings:
        shapes["lm_head.weight"] = (m.vocab_size, h)
    for layer in range(m.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nh * d, h),
            p + "self_attn.k_proj.weight": (ng * d, h),
            p + "self_attn.v_proj.weight": (ng * d, h),
            p + "self_attn.o_proj.weight": (h, nh * d),
        }
        if m.add_qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (nh * d,),
                p + "self_attn.k_proj.bias": (ng * d,),
                p + "self_attn.v_proj.bias": (ng * d,),
            }
        if m.qk_layernorm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if m.num_experts:
            shapes[p + "mlp.gate.weight"] = (m.num_experts, h)
            for e in range(m.num_experts):
                q = f"{p}mlp.experts.{e}."
                f = m.moe_ffn_hidden_size
                shapes |= {
                    q + "gate_proj.weight": (f, h),
                    q + "up_proj.weight": (f, h),
                    q + "down_proj.weight": (h, f),
                }
            if m.moe_shared_expert_ffn_hidden_size:
                q, f = p + "mlp.shared_expert.", m.moe_shared_expert_ffn_hidden_size
                shapes |= {
                    q + "gate_proj.weight": (f, h),
                    q + "up_proj.weight": (f, h),
                    q + "down_proj.weight": (h, f),
                }
        else:
            f = m.ffn_hidden_size
            shapes |= {
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
    return shapes


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_hf_megatron_hf_is_exact(family):
    m = FAMILIES[family]
    info = convert.ArchInfo.from_model_config(m)
    g = torch.Generator().manual_seed(0)
    hf = {k: torch.randn(s, generator=g) for k, s in _hf_shapes(m).items()}
    assert sorted(convert.hf_names(info)) == sorted(hf), "the table must cover every HF tensor exactly once"
    padded = m.vocab_size + 64
    back: dict[str, torch.Tensor] = {}
    for name in convert.megatron_names(info):
        full = convert.hf_to_megatron(name, hf.__getitem__, info, padded_vocab=padded)
        if "word_embeddings" in name or "output_layer" in name:
            assert full.shape[0] == padded and torch.count_nonzero(full[m.vocab_size :]) == 0
        for hf_name, t in convert.megatron_to_hf(name, full, info):
            assert hf_name not in back, f"{hf_name} exported twice"
            back[hf_name] = t
    assert sorted(back) == sorted(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_tied_output_layer_loads_from_embedding_and_is_not_exported():
    info = convert.ArchInfo.from_model_config(FAMILIES["qwen2"])
    emb = torch.randn(info.vocab_size, info.hidden_size)
    out = convert.hf_to_megatron("output_layer.weight", {"model.embed_tokens.weight": emb}.__getitem__, info)
    assert torch.equal(out, emb)
    assert convert.megatron_to_hf("output_layer.weight", out, info) == []
    assert "output_layer.weight" not in convert.megatron_names(info)


def test_qkv_is_interleaved_per_query_group():
    m = ModelConfig(num_attention_heads=4, num_query_groups=2, hidden_size=8, kv_channels=2)
    info = convert.ArchInfo.from_model_config(m)
    d, h = 2, 8
    # Row r of q/k/v tagged 100*{q:1,k:2,v:3} + r so the fused layout can be read off.
    q = (100 + torch.arange(4 * d)).float()[:, None].expand(-1, h)
    k = (200 + torch.arange(2 * d)).float()[:, None].expand(-1, h)
    v = (300 + torch.arange(2 * d)).float()[:, None].expand(-1, h)
    src = {
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
    }
    fused = convert.hf_to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", src.__getitem__, info)
    expected = [
        100,
        101,
        102,
        103,
        200,
        201,
        300,
        301,  # group 0: heads 0-1, k0, v0
        104,
        105,
        106,
        107,
        202,
        203,
        302,
        303,
    ]  # group 1: heads 2-3, k1, v1
    assert fused[:, 0].tolist() == expected


def test_canonical_name_normalises_te_local_wrappers_and_offsets():
    c = convert.canonical_name
    assert c("module.module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == (
        "decoder.layers.0.input_layernorm.weight"
    )
    assert c("decoder.layers.1.mlp.linear_fc1.layer_norm_weight", layer_offset=2) == (
        "decoder.layers.3.pre_mlp_layernorm.weight"
    )
    assert c("decoder.layers.0.mlp.experts.linear_fc2.weight1", expert_offset=4) == (
        "decoder.layers.0.mlp.experts.local_experts.5.linear_fc2.weight"
    )
    assert c(
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", layer_offset=4, expert_offset=2
    ) == ("decoder.layers.4.mlp.experts.local_experts.3.linear_fc1.weight")
    assert c("embedding.word_embeddings.weight", layer_offset=3) == "embedding.word_embeddings.weight"


@pytest.mark.parametrize(
    "name,dim",
    [
        ("decoder.layers.0.mlp.linear_fc1.weight", 0),
        ("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", 0),
        ("decoder.layers.0.mlp.linear_fc2.weight", 1),
        ("decoder.layers.0.self_attention.linear_qkv.weight", 0),
    ],
)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shard_merge_round_trip(name, dim, tp):
    full = torch.randn(16, 8)
    shards = [convert.tp_shard(name, full, tp, r, dim) for r in range(tp)]
    assert torch.equal(convert.tp_merge(name, shards, dim), full)
    if name.endswith("linear_fc1.weight") and tp > 1:  # each rank holds [gate_r; up_r]
        gate, up = full.chunk(2)
        assert torch.equal(shards[1], torch.cat([gate.chunk(tp)[1], up.chunk(tp)[1]]))


def test_unknown_names_and_families_fail_loudly():
    info = convert.ArchInfo.from_model_config(FAMILIES["qwen2"])
    with pytest.raises(KeyError, match="no HF mapping"):
        convert.hf_sources("decoder.layers.0.mlp.router.weight", info)  # dense model has no router
    with pytest.raises(ValueError, match="no name table"):
        convert.megatron_names(convert.ArchInfo(**{**info.__dict__, "family": "gpt2"}))


def test_hf_config_matches_transformers_classes():
    transformers = pytest.importorskip("transformers")
    for family in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        m = FAMILIES[family]
        cfg = convert.hf_config(m)
        hf_cfg = transformers.AutoConfig.for_model(
            **{k: v for k, v in cfg.items() if k != "model_type"}, model_type=cfg["model_type"]
        )
        model = getattr(transformers, cfg["architectures"][0])(hf_cfg)
        names = set(model.state_dict())
        ours = set(convert.hf_names(convert.ArchInfo.from_model_config(m)))
        if m.tie_embeddings:
            names.discard("lm_head.weight")
        if family == "qwen3_moe":  # transformers 5 fuses experts in memory; checkpoints keep per-expert names
            names = {n for n in names if ".mlp.experts." not in n}
            ours = {n for n in ours if ".mlp.experts." not in n}
        assert names == ours, family
    with pytest.raises(ValueError, match="shared expert"):
        convert.hf_config(FAMILIES["qwen3_moe_shared"])
