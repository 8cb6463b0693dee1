"""LoRA without a process group: bad ``model.lora`` input refused at load (naming the field and the fix),
the resume rules, the PEFT names / config / merge arithmetic of the exporters, and the base fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_acrl.config import ConfigError, config_from_dict
from megatron_acrl.config.resume_keys import allow_changes_errors
from megatron_acrl.megatron import convert, lora

MOE = dict(family="qwen3_moe", num_experts=4, add_qkv_bias=False, tie_embeddings=False)


def error_of(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    return str(info.value)


def with_lora(lo: dict | None = None, model: dict | None = None, parallel: dict | None = None) -> dict:
    return {"model": dict(model or {}, lora=lo if lo is not None else {}), "parallel": parallel or {}}


def test_defaults_build() -> None:
    cfg = config_from_dict(with_lora())
    assert cfg.model.lora is not None and cfg.model.lora.rank == 16 and cfg.model.lora.sync == "adapter"
    assert config_from_dict({}).model.lora is None


@pytest.mark.parametrize(
    ("lo", "needle"),
    [
        (dict(rank=0), "model.lora.rank: must be >= 1"),
        (dict(alpha=0), "model.lora.alpha: must be > 0"),
        (dict(dropout=1.0), "model.lora.dropout"),
        (dict(target_modules=["q_proj"]), "use the Megatron name 'linear_qkv'"),
        (dict(target_modules=["lm_head"]), "valid names: linear_qkv, linear_proj, linear_fc1, linear_fc2"),
    ],
)
def test_bad_lora_fields(lo: dict, needle: str) -> None:
    assert needle in error_of(with_lora(lo))


def test_expert_adapters_need_merged_sync() -> None:
    msg = error_of(with_lora({}, MOE))
    assert "model.lora.sync" in msg and "sync: merged" in msg and "[linear_qkv, linear_proj]" in msg
    config_from_dict(with_lora(dict(sync="merged"), MOE))  # the fix works
    config_from_dict(with_lora(dict(target_modules=["linear_qkv", "linear_proj"]), MOE))  # so does the other


def test_shared_expert_and_expert_tp_refused() -> None:
    shared = dict(MOE, moe_shared_expert_ffn_hidden_size=32)
    assert "shared expert" in error_of(with_lora(dict(sync="merged"), shared))
    msg = error_of(with_lora(dict(sync="merged"), MOE, dict(tp=2, sequence_parallel=True)))
    assert "expert tensor parallel size 1" in msg and "parallel.tp=1" in msg


def test_rank_divisible_by_tp() -> None:
    msg = error_of(with_lora(dict(rank=3), parallel=dict(tp=2)))
    assert "model.lora.rank" in msg and "use rank 4" in msg
    config_from_dict(with_lora(dict(rank=4), parallel=dict(tp=2)))


def test_disk_transport_needs_servers_on_this_host() -> None:
    remote = {"rollout": {"server_urls": ["http://10.0.0.7:30000"], "api_key_env": "K"}}
    msg = error_of({**with_lora(dict(transport="disk")), **remote})
    assert "model.lora.transport" in msg and "use transport: tensors" in msg and "10.0.0.7" in msg
    config_from_dict({**with_lora(dict(transport="tensors")), **remote})  # the fix works
    config_from_dict({**with_lora(dict(transport="auto")), **remote})  # auto picks tensors itself
    local = {"rollout": {"server_urls": ["http://127.0.0.1:30000"], "api_key_env": "K"}}
    assert config_from_dict({**with_lora(dict(transport="disk")), **local}).model.lora.transport == "disk"
    assert "model.lora.transport" in error_of(with_lora(dict(transport="nfs")))


def test_lora_fields_fixed_on_resume() -> None:
    data = {"model": {"lora": {}}}
    cfg_dict = json.loads(json.dumps(data))
    cfg = config_from_dict(cfg_dict)
    from dataclasses import asdict

    for key in ("model.lora.rank", "model.lora.target_modules", "model.lora.alpha"):
        errors = allow_changes_errors(asdict(cfg), (key,))
        assert errors and "can never change on resume" in errors[0][1], (key, errors)
    assert not allow_changes_errors(asdict(cfg), ("model.lora.dropout",))


INFO = convert.ArchInfo(
    family="qwen2",
    num_layers=1,
    hidden_size=8,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=2,
    vocab_size=16,
    tie_embeddings=True,
    qk_layernorm=False,
    add_qkv_bias=True,
)


def _adapters(r: int = 2) -> dict[str, lora.FullAdapter]:
    g = torch.Generator().manual_seed(0)
    qkv_out = (4 + 2 * 2) * 2
    shapes = {
        "decoder.layers.0.self_attention.linear_qkv.weight": (qkv_out, 8),
        "decoder.layers.0.self_attention.linear_proj.weight": (8, 8),
        "decoder.layers.0.mlp.linear_fc1.weight": (2 * 6, 8),
        "decoder.layers.0.mlp.linear_fc2.weight": (8, 6),
    }
    return {
        n: lora.FullAdapter(torch.randn(r, i, generator=g), torch.randn(o, r, generator=g), 1.5)
        for n, (o, i) in shapes.items()
    }


def test_peft_names_split_like_the_base() -> None:
    ads = _adapters()
    state = lora.peft_tensors(ads, INFO)
    p = "base_model.model.model.layers.0."
    expect = [f"{p}self_attn.{m}_proj.lora_{w}.weight" for m in "qkvo" for w in "AB"]
    expect += [f"{p}mlp.{m}_proj.lora_{w}.weight" for m in ("gate", "up", "down") for w in "AB"]
    assert sorted(state) == sorted(expect)
    qkv = ads["decoder.layers.0.self_attention.linear_qkv.weight"]
    for m in "qkv":  # one A, copied
        assert torch.equal(state[f"{p}self_attn.{m}_proj.lora_A.weight"], qkv.a)
    # B rows split exactly as the base weight's rows: the merged delta of q equals q's own B @ A
    delta = qkv.b @ qkv.a
    q_delta = convert.megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.weight", delta, INFO)[0][1]
    q = state[f"{p}self_attn.q_proj.lora_B.weight"] @ state[f"{p}self_attn.q_proj.lora_A.weight"]
    torch.testing.assert_close(q, q_delta)
    fc1 = ads["decoder.layers.0.mlp.linear_fc1.weight"]
    torch.testing.assert_close(state[f"{p}mlp.up_proj.lora_B.weight"], fc1.b[6:])


def test_merged_to_hf_folds_scaled_delta() -> None:
    ads = _adapters()
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    w = torch.randn(8, 8)
    merged = dict(lora.merged_to_hf(lambda n, t: convert.megatron_to_hf(n, t, INFO), ads)(name, w))
    ad = ads[name]
    torch.testing.assert_close(merged["model.layers.0.self_attn.o_proj.weight"], w + 1.5 * ad.b @ ad.a)
    # untouched names and meta tensors pass through
    norm = "decoder.layers.0.input_layernorm.weight"
    assert torch.equal(
        lora.merged_to_hf(lambda n, t: [(n, t)], ads)(norm, torch.ones(8))[0][1], torch.ones(8)
    )
    meta = torch.empty(8, 8, device="meta")
    assert lora.merged_to_hf(lambda n, t: [(n, t)], ads)(name, meta)[0][1].device.type == "meta"


def test_peft_config_and_dir(tmp_path: Path) -> None:
    cfg = config_from_dict(with_lora(dict(rank=8, alpha=16.0, target_modules=["linear_qkv", "linear_fc2"])))
    pc = lora.peft_adapter_config(cfg, "/models/base")
    assert pc["r"] == 8 and pc["lora_alpha"] == 16.0 and pc["peft_type"] == "LORA"
    assert pc["target_modules"] == ["q_proj", "k_proj", "v_proj", "down_proj"]
    assert pc["base_model_name_or_path"] == "/models/base" and pc["use_rslora"] is False
    state = lora.peft_tensors(_adapters(), INFO)
    out = lora.write_peft_dir(state, pc, tmp_path / "adapter")
    from safetensors.torch import load_file

    assert json.loads((out / "adapter_config.json").read_text()) == pc
    loaded = load_file(str(out / "adapter_model.safetensors"))
    assert loaded.keys() == state.keys() and all(t.dtype == torch.float32 for t in loaded.values())
    with pytest.raises(ValueError, match="model.lora is null"):
        lora.peft_adapter_config(config_from_dict({}))


def test_base_reference_tells_bases_apart(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    a = tmp_path / "a"
    a.mkdir()
    save_file({"w": torch.zeros(64, 64)}, str(a / "model.safetensors"))
    ref = lora.base_reference(a)
    assert ref["path"] == str(a) and ref == lora.base_reference(a)
    save_file(
        {"w": torch.zeros(64, 64).index_fill_(0, torch.tensor([63]), 1.0)}, str(a / "model.safetensors")
    )
    assert lora.base_reference(a)["sha256"] != ref["sha256"]  # a change in the last row's data
    t = {"w": torch.ones(3)}
    assert lora.base_reference(t)["sha256"] != lora.base_reference({"w": torch.ones(3) * 2})["sha256"]
