"""The FP8 format and scheme: e4m3 constants, :class:`Fp8Scheme`, which weights a scheme quantizes,
and the HF ``quantization_config`` it reads from and writes to a checkpoint."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
AMAX_EPS = 1e-12  # all-zero blocks get a tiny scale instead of 0/0

Granularity = Literal["block", "per_tensor", "per_channel"]


@dataclass(frozen=True)
class Fp8Scheme:
    """How weights are quantized, and which ones."""

    granularity: Granularity = "block"
    block_size: tuple[int, int] = (128, 128)
    """(rows, cols) of a scale block; block granularity only."""
    ue8m0: bool = False
    """Round scales up to powers of two (UE8M0)."""
    ignored: tuple[str, ...] = ()
    """Module names (or ``re:<regex>`` patterns) left unquantized."""

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.granularity == "block" else "weight_scale"


def scheme_from_config(quantization_config: Mapping[str, Any], *, ue8m0: bool | None = None) -> Fp8Scheme:
    """The :class:`Fp8Scheme` a checkpoint's HF ``quantization_config`` describes.

    Understands ``quant_method: fp8`` (block if ``weight_block_size`` is set, else per-tensor;
    ``ignored_layers`` / ``modules_to_not_convert``; ``scale_fmt: ue8m0``) and ``compressed-tensors``
    FP8 groups (``strategy`` tensor / channel / block, ``ignore``). ``ue8m0`` overrides the config.
    """
    qc = dict(quantization_config)
    method = qc.get("quant_method")
    ignored = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or qc.get("ignore") or ())
    cfg_ue8m0 = qc.get("scale_fmt") == "ue8m0"
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"only e4m3 FP8 is supported, config has fmt={qc.get('fmt')!r}")
        bs = qc.get("weight_block_size")
        if bs:
            scheme = Fp8Scheme("block", (int(bs[0]), int(bs[1])), cfg_ue8m0, ignored)
        else:
            scheme = Fp8Scheme("per_tensor", (128, 128), cfg_ue8m0, ignored)
    elif method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"expected one compressed-tensors config group, got {len(groups)}")
        w = groups[0].get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors weights are not FP8: {w}")
        strategy = w.get("strategy")
        if strategy == "tensor":
            scheme = Fp8Scheme("per_tensor", (128, 128), cfg_ue8m0, ignored)
        elif strategy == "channel":
            scheme = Fp8Scheme("per_channel", (128, 128), cfg_ue8m0, ignored)
        elif strategy == "block":
            bs = w.get("block_structure") or [128, 128]
            scheme = Fp8Scheme("block", (int(bs[0]), int(bs[1])), cfg_ue8m0, ignored)
        else:
            raise ValueError(f"unsupported compressed-tensors strategy {strategy!r}")
    else:
        raise ValueError(f"not an FP8 quantization_config (quant_method={method!r})")
    if ue8m0 is not None:
        scheme = Fp8Scheme(scheme.granularity, scheme.block_size, ue8m0, scheme.ignored)
    return scheme


def _module_ignored(module: str, ignored: Iterable[str]) -> bool:
    for pat in ignored:
        if pat.startswith("re:"):
            if re.fullmatch(pat[3:], module):
                return True
        elif module == pat or module.startswith(pat + ".") or module.endswith("." + pat):
            return True
    return False


def should_quantize(name: str, tensor: torch.Tensor, scheme: Fp8Scheme) -> bool:
    """True for the weights SGLang serves as FP8 under ``scheme``: 2-D ``.weight`` of decoder-layer
    projections, not a MoE router (``mlp.gate`` / ``shared_expert_gate``), not an ignored module."""
    if tensor.dim() != 2 or not name.endswith(".weight") or ".layers." not in name:
        return False
    module = name[: -len(".weight")]
    if module.endswith((".mlp.gate", ".shared_expert_gate")):
        return False
    return not _module_ignored(module, scheme.ignored)


def is_router(name: str) -> bool:
    """True for a MoE router weight (``mlp.gate`` / ``shared_expert_gate``); FP8 recipes keep it bf16."""
    return name.endswith((".mlp.gate.weight", ".shared_expert_gate.weight"))


def round_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales *up* to a power of two, bit-exactly like DeepGEMM's ceil_to_ue8m0."""
    bits = scale.float().abs().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = (exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)).clamp_(1, 254)
    return (exp << 23).view(torch.float32)


def fp8_quantization_config(scheme: Fp8Scheme) -> dict[str, Any]:
    """The HF ``quantization_config`` of a checkpoint serialized under ``scheme`` (what SGLang reads to
    serve it as FP8, and what :func:`scheme_from_config` reads back): ``quant_method: fp8`` for block
    and per-tensor scales, a compressed-tensors FP8 group for per-channel ones."""
    if scheme.granularity == "per_channel":
        qc: dict[str, Any] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "type": "float",
                        "num_bits": 8,
                        "strategy": "channel",
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": {
                        "type": "float",
                        "num_bits": 8,
                        "strategy": "token",
                        "symmetric": True,
                        "dynamic": True,
                    },
                }
            },
            "ignore": ["lm_head", *scheme.ignored],
        }
    else:
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if scheme.granularity == "block":
            qc["weight_block_size"] = list(scheme.block_size)
        if scheme.ignored:
            qc["ignored_layers"] = list(scheme.ignored)
    if scheme.ue8m0:
        qc["scale_fmt"] = "ue8m0"
    return qc
