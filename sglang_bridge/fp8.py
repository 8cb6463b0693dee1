"""FP8 (e4m3) weight quantization for the rollout copy: pure tensor functions, no SGLang import.

Formats (what SGLang's loaders expect next to each quantized ``<module>.weight``):

* block (DeepSeek-V3 / Qwen3-FP8, ``weight_block_size: [bn, bk]``): ``weight`` e4m3 ``[N, K]`` and
  ``weight_scale_inv`` fp32 ``[ceil(N/bn), ceil(K/bk)]`` with ``W ~= q * scale_inv`` per block;
  ``scale_inv = amax(block) / 448`` or, with UE8M0 (``scale_fmt: "ue8m0"``, DeepGEMM; what SGLang's own
  ``per_block_cast_to_fp8`` does), that value rounded *up* to a power of two.
* per-tensor (``quant_method: fp8`` without ``weight_block_size``): ``weight_scale`` fp32 ``[1]``.
* per-channel (compressed-tensors ``strategy: channel``): ``weight_scale`` fp32 ``[N, 1]``.

Which tensors are quantized follows the served checkpoint's ``quantization_config``
(:func:`scheme_from_config`, :func:`should_quantize`): the 2-D projection weights of decoder layers,
minus the config's ignored layers; embeddings, ``lm_head``, norms, biases and MoE routers stay in bf16
(SGLang builds those layers without a quant method).

*Fake-quant* (:func:`fake_quantize`, ``mode="fake"`` in :func:`quantize_named_tensors`) returns
``dequantize(quantize(W))`` in the original dtype: the FP8 rounding of the weights, served by a bf16
engine. A CPU SGLang cannot serve FP8 (needs Intel AMX), so CPU runs use it to reproduce FP8 weight
error; it is *not* FP8 activation/GEMM numerics, and logs/metrics must label it "fake-quant".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
_AMAX_EPS = 1e-12  # all-zero blocks get a tiny scale instead of 0/0

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


def _ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales *up* to a power of two, bit-exactly like DeepGEMM's ceil_to_ue8m0."""
    bits = scale.float().abs().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = (exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)).clamp_(1, 254)
    return (exp << 23).view(torch.float32)


def _blocks(w: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """fp32 ``[nb, bn, kb, bk]`` block view of ``w [N, K]`` (zero-padded to whole blocks) and (N, K)."""
    if w.dim() != 2:
        raise ValueError(f"block quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    bn, bk = block_size
    pn, pk = (-n) % bn, (-k) % bk
    x = w.float()
    if pn or pk:  # zero padding never raises a block's amax
        x = torch.nn.functional.pad(x, (0, pk, 0, pn))
    return x.view((n + pn) // bn, bn, (k + pk) // bk, bk), n, k


def _quantize_blocks(blocks: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp_(min=_AMAX_EPS)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = _ue8m0(scale)
    return (blocks / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _unblock(x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    nb, bn, kb, bk = x.shape
    x = x.view(nb * bn, kb * bk)
    return x if x.shape == (n, k) else x[:n, :k].contiguous()


def quantize_block(
    w: torch.Tensor, block_size: tuple[int, int] = (128, 128), *, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3: ``w [N, K]`` -> (``q`` e4m3 ``[N, K]``,
    ``scale_inv`` fp32 ``[ceil(N/bn), ceil(K/bk)]``).

    ``w ~= q.float() * scale_inv`` expanded over its ``bn x bk`` block; ``scale_inv = amax / 448``
    (power-of-two rounded up with ``ue8m0``, so no value exceeds 448 after scaling).
    """
    blocks, n, k = _blocks(w, block_size)
    q, scale = _quantize_blocks(blocks, ue8m0)
    return _unblock(q, n, k), scale.view(blocks.shape[0], blocks.shape[2]).contiguous()


def dequantize_block(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of :func:`quantize_block`: ``q [N, K]``, ``scale_inv [nb, kb]`` -> ``[N, K]`` in ``dtype``."""
    blocks, n, k = _blocks(q, block_size)
    s = scale_inv.float().view(blocks.shape[0], 1, blocks.shape[2], 1)
    return _unblock(blocks * s, n, k).to(dtype)  # not in place: blocks may alias a float32 q


def fake_quantize_block(
    w: torch.Tensor, block_size: tuple[int, int] = (128, 128), *, ue8m0: bool = False
) -> torch.Tensor:
    """``dequantize_block(quantize_block(w))`` in ``w.dtype`` without materialising the expanded scales."""
    blocks, n, k = _blocks(w, block_size)
    q, scale = _quantize_blocks(blocks, ue8m0)
    return _unblock(q.float().mul_(scale), n, k).to(w.dtype)


def quantize_per_tensor(w: torch.Tensor, *, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the tensor: ``w`` -> (``q`` e4m3 same shape, ``weight_scale`` fp32 ``[1]``)."""
    x = w.float()
    scale = (x.abs().amax().clamp(min=_AMAX_EPS) / FP8_MAX).reshape(1)
    if ue8m0:
        scale = _ue8m0(scale)
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_per_channel(w: torch.Tensor, *, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per output row: ``w [N, K]`` -> (``q`` e4m3 ``[N, K]``, ``weight_scale`` fp32 ``[N, 1]``)."""
    if w.dim() != 2:
        raise ValueError(f"per-channel quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    x = w.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=_AMAX_EPS) / FP8_MAX
    if ue8m0:
        scale = _ue8m0(scale)
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_scaled(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of per-tensor (``scale [1]``) and per-channel (``scale [N, 1]``) quantization."""
    return (q.float() * scale).to(dtype)


def quantize(w: torch.Tensor, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` -> (e4m3 tensor, fp32 scale) under ``scheme``."""
    if scheme.granularity == "block":
        return quantize_block(w, scheme.block_size, ue8m0=scheme.ue8m0)
    if scheme.granularity == "per_tensor":
        return quantize_per_tensor(w, ue8m0=scheme.ue8m0)
    return quantize_per_channel(w, ue8m0=scheme.ue8m0)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of :func:`quantize`."""
    if scheme.granularity == "block":
        return dequantize_block(q, scale, scheme.block_size, dtype)
    return dequantize_scaled(q, scale, dtype)


def fake_quantize(w: torch.Tensor, scheme: Fp8Scheme) -> torch.Tensor:
    """``dequantize(quantize(w))`` in ``w.dtype``: FP8 weight rounding for a bf16 server (fake-quant)."""
    if scheme.granularity == "block":
        return fake_quantize_block(w, scheme.block_size, ue8m0=scheme.ue8m0)
    q, s = quantize(w, scheme)
    return dequantize(q, s, scheme, w.dtype)


def quantize_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    scheme: Fp8Scheme,
    mode: Literal["real", "fake"] = "real",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream HF-named tensors through FP8 quantization.

    ``real``: each quantized ``X.weight`` becomes ``X.weight`` (e4m3) followed by its scale
    (``X.weight_scale_inv`` or ``X.weight_scale``), for an FP8 server. ``fake``: same names and dtypes
    as the input, quantized weights replaced by their dequantized values, for a bf16 server.
    Other tensors pass through unchanged. Lazy: one tensor is converted at a time.
    """
    for name, t in named_tensors:
        if not should_quantize(name, t, scheme):
            yield name, t
        elif mode == "fake":
            yield name, fake_quantize(t, scheme)
        else:
            q, s = quantize(t, scheme)
            yield name, q
            yield name[: -len("weight")] + scheme.scale_suffix, s


# -- stress emulation (the study's "truncated FP8"): harsher than any production FP8 recipe ---------

Rounding = Literal["nearest", "toward_zero"]


def to_e4m3(x: torch.Tensor, rounding: Rounding = "nearest", mantissa_bits: int = 3) -> torch.Tensor:
    """Cast already-scaled fp32 values (``|x| <= 448``) to e4m3 with the given rounding.

    ``toward_zero`` truncates the mantissa: where the round-to-nearest result overshoots ``|x|`` the
    magnitude steps one code down. e4m3fn codes are sign + 7 magnitude bits ordered like the values
    they encode, so "one code down" is an integer decrement that never touches the sign bit (an
    overshooting code has magnitude >= 1). Every weight then shrinks toward zero by up to one FP8
    step (about 6% on average at 3 mantissa bits): a biased error, unlike nearest rounding's.

    ``mantissa_bits < 3`` then clears the low ``3 - mantissa_bits`` mantissa bits (truncation toward
    zero onto a coarser e4mM grid, subnormals included since their mantissa is linear): the harshest
    "truncated FP8" knob, for stress runs only.
    """
    if not 0 <= mantissa_bits <= 3:
        raise ValueError(f"mantissa_bits must be in [0, 3] (e4m3 has 3), got {mantissa_bits}")
    if rounding not in ("nearest", "toward_zero"):
        raise ValueError(f"unknown FP8 rounding {rounding!r}; use nearest or toward_zero")
    q = x.to(FP8_DTYPE)
    if rounding == "nearest" and mantissa_bits == 3:
        return q
    bits = q.view(torch.uint8)
    if rounding == "toward_zero":
        bits = torch.where(q.float().abs() > x.abs(), bits - 1, bits)
    if mantissa_bits < 3:
        bits = bits & (0xFF ^ ((1 << (3 - mantissa_bits)) - 1))
    return bits.view(FP8_DTYPE)


def fake_quantize_stress(
    w: torch.Tensor, scheme: Fp8Scheme, rounding: Rounding = "nearest", mantissa_bits: int = 3
) -> torch.Tensor:
    """``dequantize(quantize(w))`` under ``scheme`` with :func:`to_e4m3`'s ``rounding`` and
    ``mantissa_bits``, in ``w.dtype`` (fake-quant only: no FP8 kernel serves these grids).

    Same scales as :func:`quantize` (amax / 448 per block, tensor or row, UE8M0 if asked); only the
    cast differs. With the defaults it equals :func:`fake_quantize`.
    """
    x = w.float()
    if scheme.granularity == "block":
        blocks, n, k = _blocks(w, scheme.block_size)
        amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    elif scheme.granularity == "per_tensor":
        amax = x.abs().amax().reshape(1)
    else:
        if w.dim() != 2:
            raise ValueError(f"per-channel quantization needs a 2-D weight, got shape {tuple(w.shape)}")
        amax = x.abs().amax(dim=1, keepdim=True)
    scale = amax.clamp(min=_AMAX_EPS) / FP8_MAX
    if scheme.ue8m0:
        scale = _ue8m0(scale)
    src = blocks if scheme.granularity == "block" else x
    deq = to_e4m3((src / scale).clamp_(-FP8_MAX, FP8_MAX), rounding, mantissa_bits).float().mul_(scale)
    if scheme.granularity == "block":
        deq = _unblock(deq, n, k)
    return deq.to(w.dtype)


def is_router(name: str) -> bool:
    """True for a MoE router weight (``mlp.gate`` / ``shared_expert_gate``); FP8 recipes keep it bf16."""
    return name.endswith((".mlp.gate.weight", ".shared_expert_gate.weight"))


def fake_quantize_named_stress(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    scheme: Fp8Scheme,
    rounding: Rounding = "nearest",
    mantissa_bits: int = 3,
    *,
    quantize_router: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Fake-quant stream for the stress setting: what :func:`quantize_named_tensors` does in ``fake``
    mode, with ``rounding`` / ``mantissa_bits`` and, with ``quantize_router``, the MoE router weights
    quantized too, so near-tie expert choices flip between trainer and rollout. Lazy, one tensor at
    a time."""
    for name, t in named_tensors:
        router = quantize_router and t.dim() == 2 and is_router(name)
        if router or should_quantize(name, t, scheme):
            yield name, fake_quantize_stress(t, scheme, rounding, mantissa_bits)
        else:
            yield name, t


__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8Scheme",
    "dequantize",
    "dequantize_block",
    "dequantize_scaled",
    "fake_quantize",
    "fake_quantize_block",
    "fake_quantize_named_stress",
    "fake_quantize_stress",
    "is_router",
    "quantize",
    "quantize_block",
    "quantize_named_tensors",
    "quantize_per_channel",
    "quantize_per_tensor",
    "scheme_from_config",
    "should_quantize",
    "to_e4m3",
]
