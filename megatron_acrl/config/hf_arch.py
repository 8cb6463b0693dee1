"""The model architecture of an HF checkpoint (``model.hf_path``): read from its ``config.json``.

SGLang builds the served model from that ``config.json``; the trainer builds its own from
``model.*``. A field of ``model.*`` that disagrees with the checkpoint trains a different network
from the one the servers run: a wrong shape fails somewhere in loading, a wrong RoPE base, norm
epsilon or q/k norm loads silently. So when ``hf_path`` is set, the fields below are taken from
``config.json`` where the YAML omits them, and a YAML value that disagrees is refused, naming both.
The field mapping is the inverse of :func:`megatron_acrl.megatron.convert.hf_config`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_acrl.config._base import ConfigError

_FAMILIES = {"qwen2": "qwen2", "llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
"""HF ``model_type`` -> ``model.family`` (the families convert.py maps)."""

_DIRECT = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "norm_epsilon",
    "tie_word_embeddings": "tie_embeddings",
    "attention_bias": "add_qkv_bias",
    "num_experts": "num_experts",
    "num_experts_per_tok": "moe_router_topk",
    "moe_intermediate_size": "moe_ffn_hidden_size",
}
"""HF config.json key -> ``model.*`` field, where the value carries over as it is."""


def hf_architecture(hf_path: str | Path) -> dict[str, Any] | None:
    """The ``model.*`` fields ``hf_path/config.json`` fixes (None: no config.json here, e.g. a
    cluster path inspected on a login node; the pre-flight's path check names a missing one)."""
    path = Path(hf_path) / "config.json"
    if not path.is_file():
        return None
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError([("model.hf_path", f"{path} is not readable JSON ({err})")]) from None
    arch: dict[str, Any] = {field: hf[key] for key, field in _DIRECT.items() if key in hf}
    model_type = hf.get("model_type")
    if model_type in _FAMILIES:
        arch["family"] = _FAMILIES[model_type]
        arch["qk_layernorm"] = model_type in ("qwen3", "qwen3_moe")  # Qwen3 always norms q and k
        if model_type == "qwen2":
            arch.setdefault("add_qkv_bias", True)  # HF Qwen2 always has a QKV bias
    theta = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta"))
    if theta is not None:
        arch["rotary_base"] = float(theta)
    if "head_dim" in hf and {"hidden_size", "num_attention_heads"} <= hf.keys():
        if hf["head_dim"] != hf["hidden_size"] // hf["num_attention_heads"]:
            arch["kv_channels"] = hf["head_dim"]  # only a non-default head size needs the field
    return arch


def _number(v: Any) -> float | None:
    """``v`` as a number where it is one (YAML reads ``1e-5`` and an override ``5e5`` as strings)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v) if isinstance(v, str) else None
    except ValueError:
        return None


def _agrees(field: str, mine: Any, theirs: Any) -> bool:
    """Whether the YAML's ``mine`` agrees with config.json's ``theirs`` for ``field``. The trainer
    may be built for shorter sequences than the checkpoint (``max_position_embeddings`` only bounds
    prompt + response, which the servers then never exceed), never for longer ones."""
    a, b = _number(mine), _number(theirs)
    if field == "max_position_embeddings" and a is not None and b is not None:
        return a <= b
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return mine == theirs


def apply_hf_architecture(data: dict) -> tuple[dict, dict[str, str]]:
    """``data`` (the nested config dict) with the architecture of ``model.hf_path`` filled into the
    ``model`` fields it leaves unset, and the fields so filled (-> their source, for ``--explain``).
    A ``model`` field set to another value than config.json's is a ConfigError naming both and the
    fix. No ``hf_path`` (the tiny local model, built from the config) or no config.json: unchanged."""
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("hf_path"), str):
        return data, {}
    arch = hf_architecture(model["hf_path"])
    if arch is None:
        return data, {}
    source = f"{Path(model['hf_path']) / 'config.json'}"
    errors = [
        (
            f"model.{field}",
            f"{model[field]} disagrees with {source}, which sets {field} = {value} (the servers "
            f"build the model from it): set model.{field}: {value}, or leave it out to take it "
            "from config.json"
            + (" (a smaller value is allowed)" if field == "max_position_embeddings" else ""),
        )
        for field, value in arch.items()
        if field in model and not _agrees(field, model[field], value)
    ]
    if errors:
        raise ConfigError(errors)
    filled = {field: value for field, value in arch.items() if field not in model}
    return {**data, "model": {**model, **filled}}, {f"model.{f}": source for f in filled}
