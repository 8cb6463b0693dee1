"""The CPU fast path of the correction: ``_fused_cpu.c`` through ``ctypes``, and when to take it.

On a CPU, one micro-batch's correction in eager PyTorch is a few dozen small ops and costs their
dispatch; the C loops compute the same quantities in one pass each (see the C file for the
numerics). The path is chosen once per run, explicitly: ``correction.kernel`` (``auto``, ``torch``
or ``fused_cpu``) is resolved by :func:`resolve_kernel` where the loss adapter is built, and the
resulting boolean travels down as ``fused`` to
:class:`~megatron_acrl.correction.mismatch.MismatchTensors` (the shared sums) and from there to
:func:`~megatron_acrl.correction.weights.compute_correction` (ACRL's weights). Nothing in the math
looks at the device. The PyTorch path stays the reference and the GPU path;
``tests/test_fused_cpu.py`` checks the two agree with each other and with a float64 reference.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path
from typing import get_args

import torch
from torch import Tensor

from ckernels import load_library
from megatron_acrl.config import CorrectionKernel

SOURCE = Path(__file__).with_name("_fused_cpu.c")
NUM_ROWS = 10  # rows of MismatchTensors.ROWS, in that order
NUM_PARTIALS = 23  # values of mismatch_partials (metrics._MISMATCH_NAMES)
# "no bound" for the kernel, which is compiled for finite arithmetic (an inf bound would be folded)
_NO_BOUND = 3.0e38

_p, _i64, _f32, _f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = load_library(SOURCE)
    if lib is None:
        return None
    lib.acrl_mismatch_pass.restype = None
    lib.acrl_mismatch_pass.argtypes = [_p, _p, _p, _i64, _i64, _i64, _i64, _i64, _p, _p, _p, _p]
    lib.acrl_weights_pass.restype = None
    lib.acrl_weights_pass.argtypes = [
        _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _i64,  # inputs, shape, strides
        _p, _f64, _f32, _f32, _f32, _f32, _f64,  # coef, coef0, alpha_lo, alpha_hi, w_low, w_high, inv_tok
        _p, _p, _p,  # outputs
    ]  # fmt: skip
    lib.acrl_mismatch_partials.restype = None
    lib.acrl_mismatch_partials.argtypes = [_p, _i64, _p, _f64, _f64, _f64, _p]
    return lib


def available() -> bool:
    """Whether the kernels built and loaded on this machine."""
    return _lib() is not None


KERNELS: tuple[str, ...] = get_args(CorrectionKernel)
"""The values of ``correction.kernel``."""


def resolve_kernel(kernel: str, device: torch.device | str) -> bool:
    """Whether the correction runs the fused C pass, for ``correction.kernel`` and the trainer's device.

    ``auto``: on a CPU device when the library builds, else the PyTorch path; ``torch``: never;
    ``fused_cpu``: always, refused here (with the field and the fix) when the device is not a CPU or
    the library did not build. Called once, where the loss adapter is built.
    """
    device = torch.device(device)
    if kernel == "torch":
        return False
    if kernel == "auto":
        return device.type == "cpu" and available()
    if kernel != "fused_cpu":
        raise ValueError(f"correction.kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")
    if device.type != "cpu":
        raise ValueError(
            f"correction.kernel=fused_cpu runs on CPU tensors only, but the trainer runs on {device}; "
            "set correction.kernel=auto (or torch)"
        )
    if not available():
        raise ValueError(
            f"correction.kernel=fused_cpu: {SOURCE.name} did not build (the log says why; a C compiler "
            "is needed: install gcc or set $CC); set correction.kernel=auto (or torch) to use the "
            "PyTorch path"
        )
    return True


def usable(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> bool:
    """Whether the fused pass can take these tensors: 2-D float32 CPU log-probs, a same-shape mask."""
    return (
        old_logprobs.device.type == "cpu"
        and rollout_logprobs.device.type == "cpu"
        and old_logprobs.dtype == torch.float32
        and rollout_logprobs.dtype == torch.float32
        and old_logprobs.dim() == 2
        and old_logprobs.shape == rollout_logprobs.shape == mask.shape
        and available()
    )


def _rows(x: Tensor) -> Tensor:
    """``x`` with unit stride along T (the kernel's only layout requirement)."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _mask_bytes(mask: Tensor) -> Tensor:
    m = mask if mask.dtype == torch.bool else mask != 0
    return _rows(m)


def mismatch_pass(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sequence row sums, token extrema and the controller's statistics of one micro-batch.

    Args:
        old_logprobs, rollout_logprobs: ``[B, T]`` float32 log pi_old and log mu (detached; padding
            may hold anything).
        mask: ``[B, T]`` response mask.
    Returns:
        ``seq_sums`` ``[10, B]`` float64 (rows of :attr:`MismatchTensors.ROWS`: sums over the valid
        tokens, mask set and both log-probs finite, and the count of masked-in non-finite ones),
        ``extremes`` ``[3]`` float64: max over valid tokens of -log rho, log rho and |pi_old - mu|
        (-inf if none), and
        ``discrepancy`` ``[3, 2]`` float64: for ``prob_abs``, ``logprob_abs`` and ``k3`` (rows, in
        :data:`DISCREPANCY_INDEX` order) the sum over sequences with a valid token of their mean
        distance (ACRL's Y_i) and the number of such sequences: ``acrl_discrepancy_stats`` per row,
        and ``valid`` ``[B, T]`` bool, the valid tokens.
    """
    old, roll, m = _rows(old_logprobs.detach()), _rows(rollout_logprobs.detach()), _mask_bytes(mask)
    b, t = old.shape
    # one buffer for every output: on a CPU each allocation is a call worth saving (see the module doc)
    n = NUM_ROWS * b
    out = torch.empty(n + 9, dtype=torch.float64)
    valid = torch.empty((b, t), dtype=torch.bool)
    ptr = out.data_ptr()
    _lib().acrl_mismatch_pass(  # type: ignore[union-attr]
        old.data_ptr(), roll.data_ptr(), m.data_ptr(), b, t, old.stride(0), roll.stride(0), m.stride(0),
        ptr, ptr + 8 * (n + 6), ptr + 8 * n, valid.data_ptr(),
    )  # fmt: skip
    return out[:n].view(NUM_ROWS, b), out[n + 6 :], out[n : n + 6].view(3, 2), valid


DISCREPANCY_INDEX = {"prob_abs": 0, "logprob_abs": 1, "k3": 2}


def acrl_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    advantages: Tensor,
    coef: Tensor | float,
    *,
    alpha_max: float | None,
    alpha_min: float | None = None,
    weight_low: float | None,
    weight_high: float | None,
    num_tokens: int | Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """ACRL weights ``exp(clamp(alpha * clamp(log rho)))`` and their sums, in one pass.

    The C twin of the ``acrl`` entry of ``weights.METHODS``, with ``alpha = sign(A) * coef`` as in
    ``acrl.acrl_alpha``.

    Args:
        old_logprobs, rollout_logprobs: ``[B, T]`` float32 log pi_old and log mu. mask: ``[B, T]``.
        advantages: ``[B, T]`` (any strides, e.g. a ``[B, 1]`` expanded) or ``[B, 1]``; only the sign.
        coef: ``gamma * (1 - Y / X)`` (``acrl.acrl_coefficient``), a float or ``[B]`` per sequence.
        alpha_max / alpha_min: alpha is clipped to ``[alpha_min, alpha_max]``, ``[-alpha_max,
            alpha_max]`` with ``alpha_min`` None (``acrl.alpha_bounds``); alpha is float32 here, as
            every per-token value of the kernel (the PyTorch path computes it in float64).
        weight_low / weight_high: clamp of the weights (None: none).
        num_tokens: the global token count the sums are divided by.
    Returns:
        ``weights`` ``[B, T]`` float32 (0 off the valid tokens), ``means`` ``[5]`` float64: sums over
        valid tokens of w, (w - 1)^2, alpha, |alpha| and of the saturated tokens (|alpha log rho| at
        the bound) divided by ``num_tokens`` (partial means),
        ``extremes`` ``[2]`` float64 (max w, min w; -inf/+inf if none).
    """
    old, roll, m = _rows(old_logprobs.detach()), _rows(rollout_logprobs.detach()), _mask_bytes(mask)
    b, t = old.shape
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
    sums = torch.empty(7, dtype=torch.float64)  # 5 means, then max w and min w
    _lib().acrl_weights_pass(  # type: ignore[union-attr]
        old.data_ptr(), roll.data_ptr(), m.data_ptr(), a.data_ptr(), b, t, old.stride(0), roll.stride(0),
        m.stride(0), sa_b, sa_t, None if per_seq is None else per_seq.data_ptr(), coef0,
        -_bound(alpha_max) if alpha_min is None else float(alpha_min), _bound(alpha_max),
        0.0 if weight_low is None else weight_low, _bound(weight_high),
        1.0 / max(float(num_tokens), 1.0), weights.data_ptr(), sums.data_ptr(), sums.data_ptr() + 40,
    )  # fmt: skip
    return weights, sums[:5], sums[5:]


def _bound(x: float | None) -> float:
    return _NO_BOUND if x is None or math.isinf(x) else float(x)


def mismatch_partials(
    seq_sums: Tensor, extremes: Tensor, num_tokens: int | Tensor, num_seqs: int | Tensor
) -> Tensor:
    """``[NUM_PARTIALS]`` float64 partial mismatch metrics from :func:`mismatch_pass`'s output.

    Same values, in the same order, as ``mismatch_metrics``' PyTorch path (its ``_MISMATCH_NAMES``).
    """
    n_tok, n_seq = max(float(num_tokens), 1.0), max(float(num_seqs), 1.0)
    out = torch.empty(NUM_PARTIALS, dtype=torch.float64)
    _lib().acrl_mismatch_partials(  # type: ignore[union-attr]
        seq_sums.data_ptr(), seq_sums.shape[1], extremes.data_ptr(),
        1.0 / n_tok, 1.0 / n_seq, math.log(n_seq), out.data_ptr(),
    )  # fmt: skip
    return out
