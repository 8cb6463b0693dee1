"""Stress emulation of the rollout copy (the study's "truncated FP8"), harsher than any production FP8
recipe: rounding toward zero, fewer mantissa bits, quantized MoE routers and, on request, the output
projection (``lm_head``, or the embedding table a tied model uses as its lm_head). Fake-quant only."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import Literal

import torch

from sglang_bridge.fp8.block import blocks, unblock
from sglang_bridge.fp8.native import DEFAULT_KERNEL, Fp8Kernel
from sglang_bridge.fp8.scheme import (
    AMAX_EPS,
    FP8_DTYPE,
    FP8_MAX,
    Fp8Scheme,
    is_router,
    round_ue8m0,
    should_quantize,
)

Rounding = Literal["nearest", "toward_zero"]


def _check_stress(rounding: str, mantissa_bits: int) -> None:
    if not 0 <= mantissa_bits <= 3:
        raise ValueError(f"mantissa_bits must be in [0, 3] (e4m3 has 3), got {mantissa_bits}")
    if rounding not in ("nearest", "toward_zero"):
        raise ValueError(f"unknown FP8 rounding {rounding!r}; use nearest or toward_zero")


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
    _check_stress(rounding, mantissa_bits)
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
    w: torch.Tensor,
    scheme: Fp8Scheme,
    rounding: Rounding = "nearest",
    mantissa_bits: int = 3,
    *,
    kernel: Fp8Kernel = DEFAULT_KERNEL,
) -> torch.Tensor:
    """``dequantize(quantize(w))`` under ``scheme`` with :func:`to_e4m3`'s ``rounding`` and
    ``mantissa_bits``, in ``w.dtype`` (fake-quant only: no FP8 kernel serves these grids).

    Same scales as :func:`quantize` (amax / 448 per block, tensor or row, UE8M0 if asked); only the
    cast differs. With the defaults it equals :func:`fake_quantize`. Block granularity runs the C
    kernel where ``kernel`` takes ``w`` (bit-identical to this function's PyTorch spelling).
    """
    if scheme.granularity == "block" and kernel.takes(w):
        _check_stress(rounding, mantissa_bits)
        out = torch.empty(w.shape, dtype=w.dtype)
        return kernel.fake(w, out, scheme.block_size, scheme.ue8m0, rounding, mantissa_bits)
    x = w.float()
    if scheme.granularity == "block":
        xb, n, k = blocks(w, scheme.block_size)
        amax = xb.abs().amax(dim=(1, 3), keepdim=True)
    elif scheme.granularity == "per_tensor":
        amax = x.abs().amax().reshape(1)
    else:
        if w.dim() != 2:
            raise ValueError(f"per-channel quantization needs a 2-D weight, got shape {tuple(w.shape)}")
        amax = x.abs().amax(dim=1, keepdim=True)
    scale = amax.clamp(min=AMAX_EPS) / FP8_MAX
    if scheme.ue8m0:
        scale = round_ue8m0(scale)
    src = xb if scheme.granularity == "block" else x
    deq = to_e4m3((src / scale).clamp_(-FP8_MAX, FP8_MAX), rounding, mantissa_bits).float().mul_(scale)
    if scheme.granularity == "block":
        deq = unblock(deq, n, k)
    return deq.to(w.dtype)


def fake_quantize_named_stress(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    scheme: Fp8Scheme,
    rounding: Rounding = "nearest",
    mantissa_bits: int = 3,
    *,
    quantize_router: bool = False,
    also: Collection[str] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Fake-quant stream for the stress setting: what :func:`quantize_named_tensors` does in ``fake``
    mode, with ``rounding`` / ``mantissa_bits`` and, with ``quantize_router``, the MoE router weights
    quantized too, so near-tie expert choices flip between trainer and rollout. ``also``: names of
    further 2-D weights to quantize the same way, which FP8 recipes keep in bf16 (the stress's
    ``lm_head``: every logit then carries the rounding). Lazy, one tensor at a time."""
    extra = set(also)
    for name, t in named_tensors:
        router = quantize_router and t.dim() == 2 and is_router(name)
        if router or (name in extra and t.dim() == 2) or should_quantize(name, t, scheme):
            out = fake_quantize_stress(t, scheme, rounding, mantissa_bits)
        else:
            out = t
        del t  # hold nothing between tensors: the next one is produced while this frame waits
        yield name, out
        del out
