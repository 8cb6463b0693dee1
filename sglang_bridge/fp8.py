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

import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ckernels import BASE_CFLAGS, load_library

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
    bn, bk = block_size
    if _native_ok(w):
        q = torch.empty(w.shape, dtype=FP8_DTYPE)
        s = torch.empty(-(-w.shape[0] // bn), -(-w.shape[1] // bk), dtype=torch.float32)
        _native_quant(w, q, s, block_size, ue8m0)
        return q, s
    if not _fast_ok(w, block_size):
        return _quantize_block_reference(w, block_size, ue8m0=ue8m0)
    q = torch.empty(w.shape, dtype=FP8_DTYPE)
    s = torch.empty(w.shape[0] // bn, w.shape[1] // bk, dtype=torch.float32)
    quantize_block_into(w, q, s, block_size, ue8m0=ue8m0)
    return q, s


def _quantize_block_reference(
    w: torch.Tensor, block_size: tuple[int, int] = (128, 128), *, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_block` spelled with generic ops (any shape / dtype / device): the reference
    the fast path is tested against, bit for bit."""
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
    if _native_ok(w):
        return _native_fake(w, torch.empty(w.shape, dtype=w.dtype), block_size, ue8m0)
    if not _fast_ok(w, block_size):
        return _fake_quantize_block_reference(w, block_size, ue8m0=ue8m0)
    return fake_quantize_block_into(
        w, torch.empty_like(w, memory_format=torch.contiguous_format), block_size, ue8m0=ue8m0
    )


def _fake_quantize_block_reference(
    w: torch.Tensor, block_size: tuple[int, int] = (128, 128), *, ue8m0: bool = False
) -> torch.Tensor:
    """:func:`fake_quantize_block` through the generic fp8 casts: the bit-exact reference."""
    blocks, n, k = _blocks(w, block_size)
    q, scale = _quantize_blocks(blocks, ue8m0)
    return _unblock(q.float().mul_(scale), n, k).to(w.dtype)


# -- native block path -------------------------------------------------------------------------------
# ``_fp8_block.c``: amax, scale, e4m3 rounding and (fake) dequantization of a whole weight in one C
# pass per 128-row stripe, bf16 / fp32, ragged edge blocks included, bit-identical to the reference
# (tests/bridge/test_fp8.py, stress grids included). Built on first use by ckernels/__init__.py with
# the flags below: IEEE evaluation order (no -ffast-math family, no FP contraction), because the
# e4m3 rounding is exact arithmetic that reassociation would fold away; -fno-trapping-math only lets
# the compiler turn the clamps into vector selects (no FP exception is ever inspected), which
# changes no result. The hot loops are multi-versioned for AVX-512 / AVX2 / baseline (see the C
# file). Called through ctypes, which releases the GIL, so the packing thread quantizes while the
# sending thread waits on the transfer.
# Without a C compiler everything takes the PyTorch fast path below (and the reference).

_NATIVE_SOURCE = Path(__file__).with_name("_fp8_block.c")
FP8_CFLAGS = (*BASE_CFLAGS, "-ffp-contract=off")
_NATIVE_DT = {torch.bfloat16: 0, torch.float32: 1}
USE_NATIVE = True
"""Module switch (tests flip it to compare the native path with the PyTorch one)."""
NATIVE_TABLE = True
"""Module switch: let the C quantizer and fake-quant take their AVX-512 table path for bf16 (tests
flip it to compare the table with the kernel's scalar code)."""

_p, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def _native_lib() -> ctypes.CDLL | None:
    lib = load_library(_NATIVE_SOURCE, FP8_CFLAGS)
    if lib is None:
        return None
    lib.fp8_block_fake.restype = _int
    lib.fp8_block_fake.argtypes = [_p, _i64, _i64, _i64, _int, _p, _i64, _i64, _i64, _int, _int, _int, _int]
    lib.fp8_table_path.restype = _int
    lib.fp8_table_path.argtypes = []
    lib.fp8_block_quant.restype = _int
    lib.fp8_block_quant.argtypes = [_p, _i64, _i64, _i64, _int, _p, _i64, _p, _i64, _i64, _int, _int]
    return lib


def native_available() -> bool:
    """Whether the C block quantizer built and loaded on this machine (and is switched on)."""
    return USE_NATIVE and _native_lib() is not None


def native_table_path() -> bool:
    """Whether the C fake-quant takes its table path for bf16 here (an AVX-512BW CPU, switched on)."""
    lib = _native_lib() if USE_NATIVE else None
    return NATIVE_TABLE and lib is not None and bool(lib.fp8_table_path())


def _native_ok(w: torch.Tensor, *outs: torch.Tensor) -> bool:
    """The C path takes a 2-D CPU bf16 / fp32 matrix with unit column stride (any row stride) and
    contiguous outputs."""
    return (
        w.dim() == 2
        and w.numel() > 0
        and w.dtype in _NATIVE_DT
        and w.device.type == "cpu"
        and (w.stride(1) == 1 or w.shape[1] == 1)
        and all(o.device.type == "cpu" and o.is_contiguous() for o in outs)
        and native_available()
    )


def _native_fake(
    w: torch.Tensor,
    out: torch.Tensor,
    block_size: tuple[int, int],
    ue8m0: bool,
    rounding: str = "nearest",
    mantissa_bits: int = 3,
) -> torch.Tensor:
    """``out`` (contiguous ``[N, K]`` of ``w.dtype``) <- fake-quant of ``w`` by the C kernel."""
    lib = _native_lib()
    assert lib is not None and out.shape == w.shape and out.dtype == w.dtype
    n, k = w.shape
    rc = lib.fp8_block_fake(
        w.data_ptr(), n, k, w.stride(0), _NATIVE_DT[w.dtype], out.data_ptr(), k,
        block_size[0], block_size[1], int(ue8m0), int(rounding == "toward_zero"), mantissa_bits,
        int(NATIVE_TABLE),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("fp8_block_fake: scratch allocation failed")
    return out


def _native_quant(
    w: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor, block_size: tuple[int, int], ue8m0: bool
) -> None:
    lib = _native_lib()
    n, k = w.shape
    bn, bk = block_size
    assert lib is not None and q_out.shape == w.shape and q_out.dtype == FP8_DTYPE
    assert scale_out.dtype == torch.float32 and scale_out.shape == (-(-n // bn), -(-k // bk))
    rc = lib.fp8_block_quant(
        w.data_ptr(), n, k, w.stride(0), _NATIVE_DT[w.dtype], q_out.data_ptr(), k,
        scale_out.data_ptr(), bn, bk, int(ue8m0), int(NATIVE_TABLE),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("fp8_block_quant: scratch allocation failed")


# -- fast block path ---------------------------------------------------------------------------------
# The reference functions above spell the format out with generic casts; they are slow on CPU
# (fp8 -> fp32 runs ~180 M elements/s/core) and allocate five full-size temporaries per weight. The
# fast path below computes the same numbers bit for bit (tests/bridge/test_fp8.py checks it against
# the reference on random, zero, subnormal, saturating and NaN inputs) with in-place ops on reusable
# float32 / int32 work buffers, and writes its result straight into the caller's output (a view
# into a flat send bucket).

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


def _fast_ok(w: torch.Tensor, block_size: tuple[int, int]) -> bool:
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
    amax = a.amax(dim=(1, 3), keepdim=True).view(xb.dtype).float().clamp_(min=_AMAX_EPS)
    scale = amax / FP8_MAX
    return _ue8m0(scale) if ue8m0 else scale


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


def fake_quantize_block_into(
    w: torch.Tensor,
    out: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    *,
    ue8m0: bool = False,
    workspace: Fp8Workspace | None = None,
) -> torch.Tensor:
    """Write ``fake_quantize_block(w)`` (``[N, K]``, ``w.dtype``) into ``out`` (contiguous ``[N, K]`` of
    ``w.dtype``, e.g. a view into a send bucket); returns ``out``. Bit-identical to the reference."""
    if _native_ok(w, out):
        return _native_fake(w, out, block_size, ue8m0)
    if not _fast_ok(w, block_size):  # ragged blocks / other dtypes: rare, take the reference path
        return out.copy_(_fake_quantize_block_reference(w, block_size, ue8m0=ue8m0))
    ws = workspace or Fp8Workspace()
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


def quantize_block_into(
    w: torch.Tensor,
    q_out: torch.Tensor,
    scale_out: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    *,
    ue8m0: bool = False,
    workspace: Fp8Workspace | None = None,
) -> None:
    """Write ``quantize_block(w)`` into ``q_out`` (e4m3 ``[N, K]``) and ``scale_out`` (fp32
    ``[ceil(N/bn), ceil(K/bk)]``), e.g. views into a send bucket. Bit-identical to the reference."""
    if _native_ok(w, q_out, scale_out):
        _native_quant(w, q_out, scale_out, block_size, ue8m0)
        return
    if not _fast_ok(w, block_size):
        q, s = _quantize_block_reference(w, block_size, ue8m0=ue8m0)
        q_out.copy_(q)
        scale_out.copy_(s)
        return
    ws = workspace or Fp8Workspace()
    n, k = w.shape
    bn, bk = block_size
    xb = w.contiguous().view(n // bn, bn, k // bk, bk)
    scale = _fast_block_scale(xb, ue8m0, ws)
    y = _fast_scaled(xb, scale, ws, clamp=True)
    q_out.view(xb.shape).copy_(y)  # fp32 -> e4m3 cast into place: the reference's own cast
    scale_out.copy_(scale.view(n // bn, k // bk))


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


def write_fp8_checkpoint(src: str | Path, dst: str | Path, scheme: Fp8Scheme) -> Path:
    """Write an FP8 copy of the bf16 HF checkpoint ``src`` to ``dst``; returns ``dst``.

    What a real FP8 server is started from (and what its weight-sync manifest is read from): every
    weight :func:`should_quantize` selects becomes e4m3 plus its scale (``weight_scale_inv`` for
    block scales, ``weight_scale`` otherwise), everything else is copied unchanged, and
    ``config.json`` gains :func:`fp8_quantization_config`. One safetensors file at a time (sharded
    checkpoints keep their shards; the index gains the scales). Files other than the weights
    (tokenizer, generation config) are copied. Writes into a temporary directory first, so an
    interrupted write never leaves a half-written checkpoint under ``dst``.
    """
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({cfg['quantization_config'].get('quant_method')})")
    # Several processes may write the same copy at once (each server task of a job, and the
    # trainer); each writes its own temporary directory, and the first to finish publishes it.
    tmp = dst.with_name(f"{dst.name}.partial-{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    index: dict[str, str] = {}
    for f in files:
        out = dict(quantize_named_tensors(load_file(str(f)).items(), scheme, mode="real"))
        save_file({k: v.contiguous() for k, v in out.items()}, str(tmp / f.name), metadata={"format": "pt"})
        index.update(dict.fromkeys(out, f.name))
    for other in src.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name != "config.json":
            shutil.copy2(other, tmp / other.name)
    cfg["quantization_config"] = fp8_quantization_config(scheme)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    idx = tmp / "model.safetensors.index.json"
    if idx.exists():
        meta = json.loads(idx.read_text())
        meta["weight_map"] = index
        idx.write_text(json.dumps(meta, indent=2))
    try:
        tmp.rename(dst)  # atomic; fails if another writer published dst first (or dst is in the way)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dst / "config.json").exists():
            raise
    return dst


def served_fp8_checkpoint(model_dir: str | Path, root: str | Path, scheme: Fp8Scheme) -> Path:
    """The checkpoint a real FP8 server serves for the bf16 ``model_dir``: ``model_dir`` itself if it
    is already FP8-serialized, else its FP8 copy under ``root`` in ``scheme`` (written by
    :func:`write_fp8_checkpoint` once, then reused; its name states the scheme, and a copy found
    there whose ``quantization_config`` is not ``scheme``'s is refused rather than served)."""
    model_dir = Path(model_dir)
    if json.loads((model_dir / "config.json").read_text()).get("quantization_config"):
        return model_dir
    tag = {"block": "block{}x{}".format(*scheme.block_size)}.get(scheme.granularity, scheme.granularity)
    tag += "-ue8m0" if scheme.ue8m0 else ""
    if scheme.ignored:  # which layers, not only how many: two lists of one length are two copies
        tag += "-ignore-" + hashlib.sha1("\n".join(sorted(scheme.ignored)).encode()).hexdigest()[:8]
    dst = Path(root) / f"{model_dir.name}-fp8-{tag}"
    if not (dst / "config.json").exists():
        return write_fp8_checkpoint(model_dir, dst, scheme)
    found = json.loads((dst / "config.json").read_text()).get("quantization_config")
    if found != fp8_quantization_config(scheme):
        raise ValueError(
            f"{dst} holds an FP8 copy with quantization_config {found}, not the rollout's "
            f"{fp8_quantization_config(scheme)}: delete it (it is rewritten from {model_dir})"
        )
    return dst


# -- stress emulation (the study's "truncated FP8"): harsher than any production FP8 recipe ---------

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
    w: torch.Tensor, scheme: Fp8Scheme, rounding: Rounding = "nearest", mantissa_bits: int = 3
) -> torch.Tensor:
    """``dequantize(quantize(w))`` under ``scheme`` with :func:`to_e4m3`'s ``rounding`` and
    ``mantissa_bits``, in ``w.dtype`` (fake-quant only: no FP8 kernel serves these grids).

    Same scales as :func:`quantize` (amax / 448 per block, tensor or row, UE8M0 if asked); only the
    cast differs. With the defaults it equals :func:`fake_quantize`. Block granularity runs the C
    kernel when it is available (bit-identical to this function's PyTorch spelling).
    """
    if scheme.granularity == "block" and _native_ok(w):
        _check_stress(rounding, mantissa_bits)
        out = torch.empty(w.shape, dtype=w.dtype)
        return _native_fake(w, out, scheme.block_size, scheme.ue8m0, rounding, mantissa_bits)
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
    "Fp8Workspace",
    "dequantize",
    "dequantize_block",
    "dequantize_scaled",
    "fake_quantize",
    "fake_quantize_block",
    "fake_quantize_block_into",
    "fake_quantize_named_stress",
    "fake_quantize_stress",
    "fp8_quantization_config",
    "is_router",
    "native_available",
    "quantize",
    "quantize_block",
    "quantize_block_into",
    "quantize_named_tensors",
    "quantize_per_channel",
    "quantize_per_tensor",
    "scheme_from_config",
    "served_fp8_checkpoint",
    "should_quantize",
    "to_e4m3",
    "write_fp8_checkpoint",
]
