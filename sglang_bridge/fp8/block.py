"""Block-wise e4m3 (DeepSeek-V3 / Qwen3-FP8): quantize, dequantize and fake-quantize ``[N, K]`` weights
with one fp32 ``scale_inv`` per ``bn x bk`` block.

Each entry point runs one of three spellings of the same numbers, bit for bit: the C kernel
(:mod:`sglang_bridge.fp8.native`, where the caller's :class:`Fp8Kernel` allows it and the input
suits it), the PyTorch fast path (:mod:`sglang_bridge.fp8.fast_block`, whole blocks) or the
generic-cast reference here (ragged blocks, other dtypes and devices; what the others are tested
against).
"""

from __future__ import annotations

import torch

from sglang_bridge.fp8.fast_block import (
    Fp8Workspace,
    fast_fake_quantize_block_into,
    fast_ok,
    fast_quantize_block_into,
)
from sglang_bridge.fp8.native import DEFAULT_KERNEL, Fp8Kernel
from sglang_bridge.fp8.scheme import AMAX_EPS, FP8_DTYPE, FP8_MAX, round_ue8m0


def blocks(w: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
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
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp_(min=AMAX_EPS)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = round_ue8m0(scale)
    return (blocks / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def unblock(x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``[N, K]`` of the block view ``x [nb, bn, kb, bk]`` (its padding cut off)."""
    nb, bn, kb, bk = x.shape
    x = x.view(nb * bn, kb * bk)
    return x if x.shape == (n, k) else x[:n, :k].contiguous()


def quantize_block(
    w: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    *,
    ue8m0: bool = False,
    kernel: Fp8Kernel = DEFAULT_KERNEL,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3: ``w [N, K]`` -> (``q`` e4m3 ``[N, K]``,
    ``scale_inv`` fp32 ``[ceil(N/bn), ceil(K/bk)]``).

    ``w ~= q.float() * scale_inv`` expanded over its ``bn x bk`` block; ``scale_inv = amax / 448``
    (power-of-two rounded up with ``ue8m0``, so no value exceeds 448 after scaling).
    """
    bn, bk = block_size
    if kernel.takes(w):
        q = torch.empty(w.shape, dtype=FP8_DTYPE)
        s = torch.empty(-(-w.shape[0] // bn), -(-w.shape[1] // bk), dtype=torch.float32)
        kernel.quant(w, q, s, block_size, ue8m0)
        return q, s
    if not fast_ok(w, block_size):
        return _quantize_block_reference(w, block_size, ue8m0=ue8m0)
    q = torch.empty(w.shape, dtype=FP8_DTYPE)
    s = torch.empty(w.shape[0] // bn, w.shape[1] // bk, dtype=torch.float32)
    fast_quantize_block_into(w, q, s, block_size, ue8m0, Fp8Workspace())
    return q, s


def _quantize_block_reference(
    w: torch.Tensor, block_size: tuple[int, int] = (128, 128), *, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_block` spelled with generic ops (any shape / dtype / device): the reference
    the fast path is tested against, bit for bit."""
    x, n, k = blocks(w, block_size)
    q, scale = _quantize_blocks(x, ue8m0)
    return unblock(q, n, k), scale.view(x.shape[0], x.shape[2]).contiguous()


def dequantize_block(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of :func:`quantize_block`: ``q [N, K]``, ``scale_inv [nb, kb]`` -> ``[N, K]`` in ``dtype``."""
    x, n, k = blocks(q, block_size)
    s = scale_inv.float().view(x.shape[0], 1, x.shape[2], 1)
    return unblock(x * s, n, k).to(dtype)  # not in place: x may alias a float32 q


def fake_quantize_block(
    w: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    *,
    ue8m0: bool = False,
    kernel: Fp8Kernel = DEFAULT_KERNEL,
) -> torch.Tensor:
    """``dequantize_block(quantize_block(w))`` in ``w.dtype`` without materialising the expanded scales."""
    if kernel.takes(w):
        return kernel.fake(w, torch.empty(w.shape, dtype=w.dtype), block_size, ue8m0)
    if not fast_ok(w, block_size):
        return _fake_quantize_block_reference(w, block_size, ue8m0=ue8m0)
    out = torch.empty_like(w, memory_format=torch.contiguous_format)
    return fast_fake_quantize_block_into(w, out, block_size, ue8m0, Fp8Workspace())


def _fake_quantize_block_reference(
    w: torch.Tensor, block_size: tuple[int, int] = (128, 128), *, ue8m0: bool = False
) -> torch.Tensor:
    """:func:`fake_quantize_block` through the generic fp8 casts: the bit-exact reference."""
    x, n, k = blocks(w, block_size)
    q, scale = _quantize_blocks(x, ue8m0)
    return unblock(q.float().mul_(scale), n, k).to(w.dtype)


def fake_quantize_block_into(
    w: torch.Tensor,
    out: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    *,
    ue8m0: bool = False,
    workspace: Fp8Workspace | None = None,
    kernel: Fp8Kernel = DEFAULT_KERNEL,
) -> torch.Tensor:
    """Write ``fake_quantize_block(w)`` (``[N, K]``, ``w.dtype``) into ``out`` (contiguous ``[N, K]`` of
    ``w.dtype``, e.g. a view into a send bucket); returns ``out``. Bit-identical to the reference."""
    if kernel.takes(w, out):
        return kernel.fake(w, out, block_size, ue8m0)
    if not fast_ok(w, block_size):  # ragged blocks / other dtypes: rare, take the reference path
        return out.copy_(_fake_quantize_block_reference(w, block_size, ue8m0=ue8m0))
    return fast_fake_quantize_block_into(w, out, block_size, ue8m0, workspace or Fp8Workspace())


def quantize_block_into(
    w: torch.Tensor,
    q_out: torch.Tensor,
    scale_out: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    *,
    ue8m0: bool = False,
    workspace: Fp8Workspace | None = None,
    kernel: Fp8Kernel = DEFAULT_KERNEL,
) -> None:
    """Write ``quantize_block(w)`` into ``q_out`` (e4m3 ``[N, K]``) and ``scale_out`` (fp32
    ``[ceil(N/bn), ceil(K/bk)]``), e.g. views into a send bucket. Bit-identical to the reference."""
    if kernel.takes(w, q_out, scale_out):
        kernel.quant(w, q_out, scale_out, block_size, ue8m0)
        return
    if not fast_ok(w, block_size):
        q, s = _quantize_block_reference(w, block_size, ue8m0=ue8m0)
        q_out.copy_(q)
        scale_out.copy_(s)
        return
    fast_quantize_block_into(w, q_out, scale_out, block_size, ue8m0, workspace or Fp8Workspace())
