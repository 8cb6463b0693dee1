"""The C block quantizer (``sglang_bridge/_fp8_block.c``) through ctypes, and :class:`Fp8Kernel`, the
caller's explicit choice of which block quantizer runs.

``_fp8_block.c``: amax, scale, e4m3 rounding and (fake) dequantization of a whole weight in one C pass
per 128-row stripe, bf16 / fp32, ragged edge blocks included, bit-identical to the reference
(tests/bridge/test_fp8.py, stress grids included). Built on first use by ckernels/__init__.py with
:data:`FP8_CFLAGS`: IEEE evaluation order (no -ffast-math family, no FP contraction), because the
e4m3 rounding is exact arithmetic that reassociation would fold away; -fno-trapping-math only lets
the compiler turn the clamps into vector selects (no FP exception is ever inspected), which changes
no result. The hot loops are multi-versioned for AVX-512 / AVX2 / baseline (see the C file). Called
through ctypes, which releases the GIL, so the packing thread quantizes while the sending thread
waits on the transfer. Without a C compiler everything takes the PyTorch fast path
(:mod:`sglang_bridge.fp8.fast_block`) and the reference.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ckernels import BASE_CFLAGS, load_library
from sglang_bridge.fp8.scheme import FP8_DTYPE

_NATIVE_SOURCE = Path(__file__).resolve().parent.parent / "_fp8_block.c"
FP8_CFLAGS = (*BASE_CFLAGS, "-ffp-contract=off")
_NATIVE_DT = {torch.bfloat16: 0, torch.float32: 1}

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
    """Whether the C block quantizer built and loaded on this machine."""
    return _native_lib() is not None


@dataclass(frozen=True)
class Fp8Kernel:
    """Which block quantizer runs, passed explicitly by the caller (the default: the fastest one here).

    Every block function of :mod:`sglang_bridge.fp8` takes one (``kernel=``); tests compare the
    choices against each other and against the generic reference."""

    native: bool = True
    """Run the C kernel where it built and the input suits it; False: the PyTorch fast path."""
    table: bool = True
    """Let the C kernel take its AVX-512BW table path for bf16; False: its scalar code only."""

    def takes(self, w: torch.Tensor, *outs: torch.Tensor) -> bool:
        """Whether the C kernel runs for ``w``: a 2-D CPU bf16 / fp32 matrix with unit column stride
        (any row stride) and contiguous outputs, on a machine where it built."""
        return (
            self.native
            and w.dim() == 2
            and w.numel() > 0
            and w.dtype in _NATIVE_DT
            and w.device.type == "cpu"
            and (w.stride(1) == 1 or w.shape[1] == 1)
            and all(o.device.type == "cpu" and o.is_contiguous() for o in outs)
            and native_available()
        )

    def table_path(self) -> bool:
        """Whether the C fake-quant takes its table path for bf16 here (an AVX-512BW CPU, allowed)."""
        lib = _native_lib() if self.native else None
        return self.table and lib is not None and bool(lib.fp8_table_path())

    def fake(
        self,
        w: torch.Tensor,
        out: torch.Tensor,
        block_size: tuple[int, int],
        ue8m0: bool,
        rounding: str = "nearest",
        mantissa_bits: int = 3,
    ) -> torch.Tensor:
        """``out`` (contiguous ``[N, K]`` of ``w.dtype``) <- fake-quant of ``w [N, K]`` by the C kernel."""
        lib = _native_lib()
        assert lib is not None and out.shape == w.shape and out.dtype == w.dtype
        n, k = w.shape
        rc = lib.fp8_block_fake(
            w.data_ptr(), n, k, w.stride(0), _NATIVE_DT[w.dtype], out.data_ptr(), k,
            block_size[0], block_size[1], int(ue8m0), int(rounding == "toward_zero"), mantissa_bits,
            int(self.table),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("fp8_block_fake: scratch allocation failed")
        return out

    def quant(
        self,
        w: torch.Tensor,
        q_out: torch.Tensor,
        scale_out: torch.Tensor,
        block_size: tuple[int, int],
        ue8m0: bool,
    ) -> None:
        """``q_out`` (e4m3 ``[N, K]``), ``scale_out`` (fp32 ``[ceil(N/bn), ceil(K/bk)]``) <- block
        quantization of ``w [N, K]`` by the C kernel."""
        lib = _native_lib()
        n, k = w.shape
        bn, bk = block_size
        assert lib is not None and q_out.shape == w.shape and q_out.dtype == FP8_DTYPE
        assert scale_out.dtype == torch.float32 and scale_out.shape == (-(-n // bn), -(-k // bk))
        rc = lib.fp8_block_quant(
            w.data_ptr(), n, k, w.stride(0), _NATIVE_DT[w.dtype], q_out.data_ptr(), k,
            scale_out.data_ptr(), bn, bk, int(ue8m0), int(self.table),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("fp8_block_quant: scratch allocation failed")


DEFAULT_KERNEL = Fp8Kernel()
"""The C kernel with its table path where this machine has them, else the PyTorch fast path."""
