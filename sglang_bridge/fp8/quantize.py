"""FP8 under a whole :class:`Fp8Scheme`: the per-tensor and per-channel quantizers, ``quantize`` /
``dequantize`` / ``fake_quantize`` for any granularity, and a lazy stream of HF-named tensors through
them (:func:`quantize_named_tensors`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal

import torch

from sglang_bridge.fp8.block import dequantize_block, fake_quantize_block, quantize_block
from sglang_bridge.fp8.scheme import AMAX_EPS, FP8_DTYPE, FP8_MAX, Fp8Scheme, round_ue8m0, should_quantize


def quantize_per_tensor(w: torch.Tensor, *, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the tensor: ``w`` -> (``q`` e4m3 same shape, ``weight_scale`` fp32 ``[1]``)."""
    x = w.float()
    scale = (x.abs().amax().clamp(min=AMAX_EPS) / FP8_MAX).reshape(1)
    if ue8m0:
        scale = round_ue8m0(scale)
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_per_channel(w: torch.Tensor, *, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per output row: ``w [N, K]`` -> (``q`` e4m3 ``[N, K]``, ``weight_scale`` fp32 ``[N, 1]``)."""
    if w.dim() != 2:
        raise ValueError(f"per-channel quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    x = w.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=AMAX_EPS) / FP8_MAX
    if ue8m0:
        scale = round_ue8m0(scale)
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
