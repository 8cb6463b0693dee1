"""The CPU fast path of the correction: ``_fused_cpu.c`` through ``ctypes``.

On a CPU, one micro-batch's correction in eager PyTorch is a few dozen small ops and costs their
dispatch; the two C loops compute the same quantities in one pass each (see the C file for the
numerics). :class:`~megatron_acrl.correction.metrics.MismatchTensors` and
:func:`~megatron_acrl.correction.weights.compute_correction` use them automatically for float32 CPU
tensors when the library builds (:mod:`ckernels`), and fall back to their PyTorch path,
which stays the reference and the GPU path, otherwise. ``tests/test_fused_cpu.py`` checks the two
paths agree.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch
from torch import Tensor

from ckernels import load_library

SOURCE = Path(__file__).with_name("_fused_cpu.c")
NUM_ROWS = 9  # rows of MismatchTensors.ROWS, in that order
# "no bound" for the kernel, which is compiled for finite arithmetic (an inf bound would be folded)
_NO_BOUND = 3.0e38

_p, _i64, _f32, _f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = load_library(SOURCE)
    if lib is None:
        return None
    lib.acrl_mismatch_pass.restype = None
    lib.acrl_mismatch_pass.argtypes = [_p, _p, _p, _i64, _i64, _i64, _i64, _i64, _p, _p, _p]
    lib.acrl_weights_pass.restype = None
    lib.acrl_weights_pass.argtypes = [
        _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _i64,  # inputs, shape, strides
        _p, _f64, _f32, _f32, _f32, _f64,  # coef, coef0, alpha_max, w_low, w_high, inv_tokens
        _p, _p, _p,  # outputs
    ]  # fmt: skip
    lib.acrl_mismatch_partials.restype = None
    lib.acrl_mismatch_partials.argtypes = [_p, _i64, _p, _f64, _f64, _f64, _p]
    return lib


def available() -> bool:
    """Whether the kernels built and loaded on this machine."""
    return _lib() is not None


def usable(logp: Tensor, logq: Tensor, mask: Tensor) -> bool:
    """Whether the fused path applies: 2-D float32 CPU log-probs and a same-shape mask."""
    return (
        logp.device.type == "cpu"
        and logq.device.type == "cpu"
        and logp.dtype == torch.float32
        and logq.dtype == torch.float32
        and logp.dim() == 2
        and logp.shape == logq.shape == mask.shape
        and available()
    )


def _rows(x: Tensor) -> Tensor:
    """``x`` with unit stride along T (the kernel's only layout requirement)."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _mask_bytes(mask: Tensor) -> Tensor:
    m = mask if mask.dtype == torch.bool else mask != 0
    return _rows(m)


def mismatch_pass(logp: Tensor, logq: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sequence row sums, token extrema and the controller's statistics of one micro-batch.

    Args:
        logp, logq: ``[B, T]`` float32 log pi and log mu (detached; padding may hold anything).
        mask: ``[B, T]`` response mask.
    Returns:
        ``seq_sums`` ``[9, B]`` float64 (rows of :attr:`MismatchTensors.ROWS`), ``extremes`` ``[3]``
        float64: max over valid tokens of -log rho, log rho and |pi - mu| (-inf if none), and
        ``discrepancy`` ``[3, 2]`` float64: for ``prob_abs``, ``logprob_abs`` and ``k3`` (rows, in
        :data:`DISCREPANCY_INDEX` order) the sum over sequences with a valid token of their mean
        distance (ACRL's Y_i) and the number of such sequences: ``acrl_discrepancy_stats`` per row.
    """
    lp, lq, m = _rows(logp.detach()), _rows(logq.detach()), _mask_bytes(mask)
    b, t = lp.shape
    # one buffer for every output: on a CPU each allocation is a call worth saving (see the module doc)
    n = NUM_ROWS * b
    out = torch.empty(n + 9, dtype=torch.float64)
    ptr = out.data_ptr()
    _lib().acrl_mismatch_pass(  # type: ignore[union-attr]
        lp.data_ptr(), lq.data_ptr(), m.data_ptr(), b, t, lp.stride(0), lq.stride(0), m.stride(0),
        ptr, ptr + 8 * (n + 6), ptr + 8 * n,
    )  # fmt: skip
    return out[:n].view(NUM_ROWS, b), out[n + 6 :], out[n : n + 6].view(3, 2)


DISCREPANCY_INDEX = {"prob_abs": 0, "logprob_abs": 1, "k3": 2}


def acrl_weights(
    logp: Tensor,
    logq: Tensor,
    mask: Tensor,
    advantages: Tensor,
    coef: Tensor | float,
    *,
    alpha_max: float | None,
    weight_low: float | None,
    weight_high: float | None,
    num_tokens: int | Tensor = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    """ACRL weights ``exp(clamp(alpha * clamp(log rho)))`` and their sums, in one pass.

    Args:
        logp, logq: ``[B, T]`` float32 log pi_old and log mu. mask: ``[B, T]``.
        advantages: ``[B, T]`` (any strides, e.g. a ``[B, 1]`` expanded) or ``[B, 1]``; only the sign.
        coef: ``gamma * (1 - Y / X)``, a float or ``[B]`` per sequence.
        alpha_max: bound on ``|alpha|``; weight_low / weight_high: clamp of the weights (None: none).
        num_tokens: the global token count the sums are divided by.
    Returns:
        ``weights`` ``[B, T]`` float32 (0 on padding), ``means`` ``[4]`` float64: sums over valid
        tokens of w, w^2, alpha, |alpha| divided by ``num_tokens`` (partial means),
        ``extremes`` ``[2]`` float64 (max w, min w; -inf/+inf if none).
    """
    lp, lq, m = _rows(logp.detach()), _rows(logq.detach()), _mask_bytes(mask)
    b, t = lp.shape
    a = advantages.detach()
    if a.dtype != torch.float32:
        a = a.float()
    if a.dim() == 1:
        a = a.unsqueeze(-1)
    if a.shape[0] != b or a.shape[-1] not in (1, t):
        raise ValueError(f"advantages of shape {tuple(advantages.shape)} do not match log-probs [{b}, {t}]")
    sa_b, sa_t = a.stride(0), (0 if a.shape[-1] == 1 else a.stride(1))
    per_seq = None
    if isinstance(coef, Tensor):
        per_seq = coef.detach().to(torch.float64).contiguous()
        coef0 = 0.0
    else:
        coef0 = float(coef)
    weights = torch.empty((b, t), dtype=torch.float32)
    sums = torch.empty(6, dtype=torch.float64)  # 4 means, then max w and min w
    _lib().acrl_weights_pass(  # type: ignore[union-attr]
        lp.data_ptr(), lq.data_ptr(), m.data_ptr(), a.data_ptr(), b, t, lp.stride(0), lq.stride(0),
        m.stride(0), sa_b, sa_t, None if per_seq is None else per_seq.data_ptr(), coef0,
        _bound(alpha_max), 0.0 if weight_low is None else weight_low, _bound(weight_high),
        1.0 / max(float(num_tokens), 1.0), weights.data_ptr(), sums.data_ptr(), sums.data_ptr() + 32,
    )  # fmt: skip
    return weights, sums[:4], sums[4:]


def _bound(x: float | None) -> float:
    return _NO_BOUND if x is None or math.isinf(x) else float(x)


def mismatch_partials(
    seq_sums: Tensor, extremes: Tensor, num_tokens: int | Tensor, num_seqs: int | Tensor
) -> Tensor:
    """``[17]`` float64 partial mismatch metrics from :func:`mismatch_pass`'s output.

    Same values, in the same order, as ``mismatch_metrics``' PyTorch path (its ``_MISMATCH_NAMES``).
    """
    n_tok, n_seq = max(float(num_tokens), 1.0), max(float(num_seqs), 1.0)
    out = torch.empty(17, dtype=torch.float64)
    _lib().acrl_mismatch_partials(  # type: ignore[union-attr]
        seq_sums.data_ptr(), seq_sums.shape[1], extremes.data_ptr(),
        1.0 / n_tok, 1.0 / n_seq, math.log(n_seq), out.data_ptr(),
    )  # fmt: skip
    return out
