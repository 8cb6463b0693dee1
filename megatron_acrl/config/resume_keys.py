"""Which config keys a resume checks against its checkpoint, and which of them a user may change.

A resume refuses a config that differs from the checkpoint's in a key that changes the model or the
data (:data:`RESUME_KEYS`) unless ``training.resume_allow_changes`` names it. Some of those keys can
never change on resume, named or not: they set the shapes (or the presence) of the checkpoint's
tensors (:data:`FIXED_ON_RESUME`), so the load would fail after the servers started. The entries of
``resume_allow_changes`` are checked here, when the config loads: a misspelt one is refused with
the nearest key, a fixed one with why.
"""

from __future__ import annotations

import difflib
from typing import Any

RESUME_KEYS = ("model.", "task.", "training.seed", "algorithm.name")
"""Config keys (prefixes) that change the model or the data: a resume must not change them unless
``training.resume_allow_changes`` names them."""

_SHAPES = "sets the shapes of the checkpoint's weight tensors"
FIXED_ON_RESUME: dict[str, str] = {
    "model.family": "selects the layer layout and weight names of the checkpoint",
    "model.num_layers": _SHAPES,
    "model.hidden_size": _SHAPES,
    "model.ffn_hidden_size": _SHAPES,
    "model.num_attention_heads": _SHAPES,
    "model.num_query_groups": _SHAPES,
    "model.kv_channels": _SHAPES,
    "model.vocab_size": _SHAPES,
    "model.num_experts": _SHAPES,
    "model.moe_ffn_hidden_size": _SHAPES,
    "model.moe_shared_expert_ffn_hidden_size": _SHAPES,
    "model.qk_layernorm": "adds or removes the q/k norm weights the checkpoint holds",
    "model.add_qkv_bias": "adds or removes the QKV bias the checkpoint holds",
    "model.tie_embeddings": "adds or removes the separate output layer the checkpoint holds",
    "model.lora": "switches between a checkpoint of adapters only and one of full weights",
    "model.lora.rank": "sets the shapes of the checkpoint's adapter tensors",
    "model.lora.target_modules": "selects which adapter tensors the checkpoint holds",
    "model.lora.alpha": "scales the adapters: the checkpoint's adapters would compute another model",
}
"""Keys no resume may change (why each): the checkpoint's tensors would not load."""


def _flat_keys(d: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for k, v in d.items():
        out += _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


def allow_changes_errors(config: dict[str, Any], allowed: tuple[str, ...]) -> list[tuple[str, str]]:
    """Why each entry of ``training.resume_allow_changes`` (``allowed``) is wrong, given the whole
    config as a nested dict (``config_to_dict``): not a key, not one a resume checks, or one no
    resume may change. Empty: every entry is a key a resume may be told to accept."""
    keys = _flat_keys(config)
    checked = [k for k in keys if k.startswith(RESUME_KEYS)]
    errors: list[tuple[str, str]] = []
    field = "training.resume_allow_changes"
    for entry in allowed:
        if entry in FIXED_ON_RESUME:
            errors.append(
                (
                    field,
                    f"{entry} can never change on resume: it {FIXED_ON_RESUME[entry]}, so the checkpoint "
                    f"would not load. Remove it from the list, and to use another {entry} start fresh "
                    "in a new training.checkpoint_dir",
                )
            )
        elif entry not in keys:
            near = difflib.get_close_matches(entry, checked, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}?" if near else f"the keys it takes: {', '.join(RESUME_KEYS)}*"
            errors.append((field, f"{entry!r} is not a config key; {hint}"))
        elif entry not in checked:
            errors.append(
                (
                    field,
                    f"{entry} may change on every resume without being listed (only model.*, task.*, "
                    "training.seed and algorithm.name are checked against the checkpoint): remove it",
                )
            )
    return errors
