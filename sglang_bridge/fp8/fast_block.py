"""The PyTorch fast block path: the block quantizers of :mod:`sglang_bridge.fp8.block` in in-place
ops on reusable work buffers (:class:`Fp8Workspace`), written straight into the caller's outputs.

The reference functions spell the format out with generic casts; they are slow on CPU (fp8 -> fp32
runs ~180 M elements/s/core) and allocate five full-size temporaries per weight. This path computes
the same numbers bit for bit (tests/bridge/test_fp8.py checks it against the reference on random,
zero, subnormal, saturating and NaN inputs) with in-place ops on reusable float32 / int32 work
buffers, and writes its result straight into the caller's output (a view into a flat send bucket).
It takes fp16 weights, and everything when the C kernel is not chosen or did not build.
"""

from __future__ import annotations

import torch

from sglang_bridge.fp8.scheme import AMAX_EPS, FP8_MAX, round_ue8m0

_E4M3_MIN_NORMAL_BITS = 121 << 23  # fp32 exponent field of 2^-6, e4m3's smallest normal
_E4M3_STEP_SHIFT = 3 << 23  # 3 mantissa bits: the grid step is 2^(exponent - 3)
_INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_ABS_MASK = {torch.int16: 0x7FFF, torch.int32: 0x7FFFFFFF}


class Fp8Workspace:
    """Grow-only float32 / int32 / bit-abs scratch for the fast block quantizers.

    One per thread (the weight-sync packer owns one); reused across tensors and syncs so a steady
    state allocates nothing."""

    def __init__(self) -> None:
        self._bufs: dict[torch.dtype, torch.Tensor] = {}

    def get(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A contiguous 1-D ``[numel]`` tensor of ``dtype`` (contents undefined)."""
        buf = self._bufs.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = self._bufs[dtype] = torch.empty(numel, dtype=dtype)
        return buf[:numel]


def fast_ok(w: torch.Tensor, block_size: tuple[int, int]) -> bool:
    """The fast path needs whole blocks of a CPU bf16 / fp16 / fp32 matrix (no padding copy)."""
    return (
        w.dim() == 2
        and w.numel() > 0
        and w.dtype in _INT_OF
        and w.device.type == "cpu"
        and w.shape[0] % block_size[0] == 0
        and w.shape[1] % block_size[1] == 0
    )


def _fast_block_scale(xb: torch.Tensor, ue8m0: bool, ws: Fp8Workspace) -> torch.Tensor:
    """fp32 ``[nb, 1, kb, 1]`` scales of the block view ``xb [nb, bn, kb, bk]``, equal to the reference's.

    |x| is taken on the bit pattern (clear the sign bit) and the block max on the integers: for
    non-negative IEEE floats integer order is value order, NaN above inf, so the max (and NaN
    propagation) is the reference's ``abs().amax()``, with one int16 pass instead of two fp32 copies.
    """
    it = _INT_OF[xb.dtype]
    a = ws.get(it, xb.numel()).view(xb.shape)
    torch.bitwise_and(xb.view(it), _ABS_MASK[it], out=a)
    amax = a.amax(dim=(1, 3), keepdim=True).view(xb.dtype).float().clamp_(min=AMAX_EPS)
    scale = amax / FP8_MAX
    return round_ue8m0(scale) if ue8m0 else scale


def _fast_scaled(xb: torch.Tensor, scale: torch.Tensor, ws: Fp8Workspace, clamp: bool) -> torch.Tensor:
    """fp32 ``xb / scale`` of ``xb [nb, bn, kb, bk]`` in the workspace (same shape), clamped to
    ±448 if ``clamp``.

    Copy-then-divide in place: a bf16 -> fp32 copy plus a same-dtype broadcast divide is faster
    than one mixed-dtype broadcast divide, and it is the same IEEE division as the reference's.
    The clamp can only act on the one-ulp overshoot ``fl(x / fl(amax / 448))`` may have: |y| is at
    most 448 + 1 ulp (448.00003), which e4m3 rounding maps to 448 anyway. The real path keeps the
    clamp in front of the generic fp8 cast, as the reference does; the fake path skips the pass.
    """
    y = ws.get(torch.float32, xb.numel()).view(xb.shape)
    y.copy_(xb)
    y.div_(scale)
    return y.clamp_(-FP8_MAX, FP8_MAX) if clamp else y


def _round_e4m3_(y: torch.Tensor, ws: Fp8Workspace) -> torch.Tensor:
    """Round fp32 ``y`` (``|y| <= 448`` + 1 ulp, or NaN) in place to an integral ``k``, ``y ~= k * step``;
    returns ``step`` (fp32, same shape, in the workspace) so that ``k * step`` is the e4m3 value.

    e4m3 keeps 3 mantissa bits, so the grid step is 2^(e-3) for ``|y|`` in [2^e, 2^(e+1)), and the
    fixed 2^-9 in the subnormal range below 2^-6: the step's bit pattern is y's exponent field
    clamped below at 2^-6, minus 3. ``y / step`` is exact (power of two), ``round`` is
    round-half-to-even like the fp8 cast, keeps the sign of zero and propagates NaN - so ``k * step``
    is exactly ``y.to(float8_e4m3fn).float()``, without the slow scalar casts.
    """
    step = ws.get(torch.int32, y.numel()).view(y.shape)
    torch.bitwise_and(y.view(torch.int32), 0x7F800000, out=step)
    step.clamp_(min=_E4M3_MIN_NORMAL_BITS).sub_(_E4M3_STEP_SHIFT)
    stepf = step.view(torch.float32)
    y.div_(stepf).round_()
    return stepf


def fast_fake_quantize_block_into(
    w: torch.Tensor, out: torch.Tensor, block_size: tuple[int, int], ue8m0: bool, ws: Fp8Workspace
) -> torch.Tensor:
    """``out`` (contiguous ``[N, K]`` of ``w.dtype``) <- fake-quant of ``w [N, K]`` (whole blocks only,
    see :func:`fast_ok`); returns ``out``."""
    n, k = w.shape
    bn, bk = block_size
    shape = (n // bn, bn, k // bk, bk)
    xb = w.contiguous().view(shape)
    scale = _fast_block_scale(xb, ue8m0, ws)
    y = _fast_scaled(xb, scale, ws, clamp=False)
    step = _round_e4m3_(y, ws)
    # (k * step) * scale == k * (step * scale) exactly: step is a power of two. The final multiply
    # rounds once to fp32 and the write rounds once to w.dtype, as the reference's two casts do.
    step.mul_(scale)
    torch.mul(y, step, out=out.view(shape))
    return out


def fast_quantize_block_into(
    w: torch.Tensor,
    q_out: torch.Tensor,
    scale_out: torch.Tensor,
    block_size: tuple[int, int],
    ue8m0: bool,
    ws: Fp8Workspace,
) -> None:
    """``q_out`` (e4m3 ``[N, K]``), ``scale_out`` (fp32 ``[N/bn, K/bk]``) <- block quantization of
    ``w [N, K]`` (whole blocks only, see :func:`fast_ok`)."""
    n, k = w.shape
    bn, bk = block_size
    xb = w.contiguous().view(n // bn, bn, k // bk, bk)
    scale = _fast_block_scale(xb, ue8m0, ws)
    y = _fast_scaled(xb, scale, ws, clamp=True)
    q_out.view(xb.shape).copy_(y)  # fp32 -> e4m3 cast into place: the reference's own cast
    scale_out.copy_(scale.view(n // bn, k // bk))
