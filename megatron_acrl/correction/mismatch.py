"""The shared intermediates of one micro-batch: :class:`MismatchTensors`, built once per micro-batch.

Inputs are the trainer's ``log pi_old`` (``old_logprobs``) and the rollout engine's ``log mu``
(``rollout_logprobs``) of the sampled tokens, both ``[B, T]``, and a response mask ``[B, T]``
(1 on response tokens). Padding may hold anything (even inf/nan): it never reaches a result.
Everything downstream -- the mismatch metrics, the correction weights of every method and the ACRL
controller's statistics -- reads these tensors instead of recomputing them.

Who computes them is chosen by the caller, once (``correction.kernel``, resolved by the loss
adapter): ``fused=True`` runs the C pass of :mod:`~megatron_acrl.correction.fused_cpu`,
``fused=False`` the PyTorch path, which is the reference and the GPU path.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from megatron_acrl.correction import fused_cpu

# exp() of a log-ratio beyond this bound is treated as saturated: rho = e^20 ~ 5e8 is already a
# catastrophic mismatch, and the bound keeps rho^2 finite in float32.
LOG_RATIO_BOUND = 20.0


@functools.lru_cache(maxsize=64)
def cached_const(value: float | tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small constant tensor, built once per (value, dtype, device).

    Every ``torch.tensor``/``torch.full`` call is a dispatch; on a 16 x 512 micro-batch the whole
    correction is a few dozen small ops, so constants are worth caching. Never mutate the result.
    """
    return torch.tensor(value, dtype=dtype, device=device)


class MismatchTensors:
    """Shared intermediates of one micro-batch, computed once for metrics, weights and ACRL.

    Everything is detached. A token counts (is *valid*) when its mask is set and both log-probs are
    finite: a NaN/Inf log-prob on a masked-in token is dropped like padding, counted in the
    ``nonfinite`` row (``mismatch/nonfinite_tokens``), and never reaches a statistic, a weight or
    a gradient (the loss masks with :attr:`mask`; the caller's global token counts should come from
    :func:`valid_mask` too). Off the valid tokens ``log pi_old = log mu = log rho = 0``, so every
    per-token quantity below is exactly 0 there and sums need no further masking.

    The PyTorch path computes every per-token row in float64 (differences of nearly equal numbers,
    ``|pi_old - mu|`` and ``rho - 1 - log rho`` near rho = 1, keep their digits) in one
    ``[K, B, T]`` buffer written in place and reduced once: on a micro-batch the correction is a few
    dozen small ops, and their number, not their size, is what it costs.

    With ``fused=True`` the sums and extrema come from one C pass instead
    (:mod:`~megatron_acrl.correction.fused_cpu`), and the per-token rows are only built, by the
    PyTorch path, if something asks for them.

    Args:
        old_logprobs: ``[B, T]`` log pi_old. rollout_logprobs: ``[B, T]`` log mu.
        mask: ``[B, T]`` response mask (bool or 0/1).
        fused: run the fused C pass (needs 2-D float32 CPU log-probs and a built library: the
            caller resolves ``correction.kernel`` with :func:`fused_cpu.resolve_kernel`) or the
            PyTorch path.

    Attributes:
        mask_in: ``[B, T]`` bool, the caller's mask. mask: ``[B, T]`` bool, the valid tokens;
            ``mask_f``: the same as a float64 row; ``pad``: 0 on valid tokens, -inf elsewhere (built on
            demand on the fused path). dtype: the promoted dtype of the two log-prob tensors (the
            weights' dtype).
        log_ratio: ``[B, T]`` float64 ``log rho = log pi_old - log mu``.
        clamped: ``[B, T]`` ``log rho`` clamped to +-LOG_RATIO_BOUND.
        rho: ``[B, T]`` ``exp(clamped)``.
        per_token: ``[K, B, T]`` float64 rows named by :attr:`ROWS`.
        seq_sums: ``[K, B]`` float64 row sums over T; ``seq_means``: the same over each sequence's
            valid tokens (0 for an empty sequence), shared by the controller's Y and the metrics.
        seq_max: PyTorch path, ``[3, B]``: per sequence the max over valid tokens of -log rho, log
            rho and |pi_old - mu| (-inf for a sequence without one).
        extremes: ``[3]`` the same over the whole micro-batch.
        lens: ``[B]`` valid tokens per sequence (float64); ``lens_c``: the same, at least 1.
        valid_f: ``[B]`` float64, 1 for sequences with a valid token, else 0.
        discrepancy: fused path only, ``[3, 2]`` float64: per distance (``prob_abs``, ``logprob_abs``,
            ``k3``) the sum over valid sequences of their mean and their number (ACRL's statistics).
    """

    ROWS = (
        "old_logprobs", "rollout_logprobs", "neg_log_ratio", "log_ratio", "prob_abs", "logprob_abs", "k3",
        "rho_sq_m1", "mask", "nonfinite",
    )  # fmt: skip

    def __init__(self, old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, fused: bool):
        m = mask if mask.dtype == torch.bool else mask.bool()
        self.mask_in, self.old_logprobs, self.rollout_logprobs = (
            m,
            old_logprobs.detach(),
            rollout_logprobs.detach(),
        )
        self.dtype = torch.promote_types(old_logprobs.dtype, rollout_logprobs.dtype)
        if fused and not fused_cpu.usable(self.old_logprobs, self.rollout_logprobs, m):
            raise ValueError(
                "MismatchTensors(fused=True) needs 2-D float32 CPU log-probs and a built "
                "correction/_fused_cpu.c (see the log for why it did not build); "
                "correction.kernel=torch runs the PyTorch path"
            )
        self.fused = fused
        self.discrepancy: Tensor | None = None  # fused: [3, 2] (sum of Y_i, count) per distance
        if fused:
            self.seq_sums, self.extremes, self.discrepancy, self.mask = fused_cpu.mismatch_pass(
                self.old_logprobs, self.rollout_logprobs, m
            )
        else:
            self._token_rows()

    @functools.cached_property
    def lens(self) -> Tensor:
        return self.seq_sums[8]

    @functools.cached_property
    def lens_c(self) -> Tensor:
        return self.lens.clamp_min(1)

    @functools.cached_property
    def seq_means(self) -> Tensor:
        """``[K, B]`` float64: every row's mean over each sequence's valid tokens (0 for an empty one).

        Row ``mask`` is therefore 1 for a sequence with a valid token, else 0 (``valid_f``).
        """
        return self.seq_sums / self.lens_c

    @functools.cached_property
    def valid_f(self) -> Tensor:
        return self.seq_means[8]

    @functools.cached_property
    def mask(self) -> Tensor:
        """``[B, T]`` bool, the valid tokens (set by the fused pass; built on demand by the PyTorch path)."""
        return self._row_attr("_mask_f") > 0

    def _token_rows(self) -> None:
        """The PyTorch path: every per-token row in float64, and (unless fused) the sums and maxima.

        At a micro-batch's size every op costs about the same, a dispatch on a CPU and a kernel launch
        on a GPU, whatever its size: so the fewest ops, all on one dtype (a bool operand costs a
        casting loop), no ``isfinite`` (three ops inside: ``d * 0 == 0`` exactly when ``d`` is finite)
        and no ``torch.where`` (a slow kernel; NaN/Inf go by ``nan_to_num``, the mask by multiplying).
        """
        m_in, dev = self.mask_in, self.old_logprobs.device
        rows = torch.empty((len(self.ROWS), *m_in.shape), dtype=torch.float64, device=dev)
        lp_old, lp_roll, nd, d, dp, ad, k3, chi, mf, bad = rows.unbind(0)
        lp_old.copy_(self.old_logprobs)
        lp_roll.copy_(self.rollout_logprobs)
        bad.copy_(m_in)  # the caller's mask until the valid tokens are known
        torch.sub(lp_old, lp_roll, out=d)  # exact for float32 inputs; not finite iff an input is not
        torch.mul(d, 0.0, out=mf).eq_(0.0).mul_(bad)  # 1.0 on the valid tokens, else +0.0
        # rows 0-3 (row 2 is written next) to 0 off the valid tokens, where they may hold NaN/inf
        rows[:4].nan_to_num_(0.0, 0.0, 0.0).mul_(mf)
        bad.sub_(mf)  # masked-in tokens with a non-finite log-prob
        torch.neg(d, out=nd)  # k1 per token; its max is -min(log rho)
        e = torch.exp(rows[:2])
        torch.sub(e[0], e[1], out=dp).abs_()
        torch.abs(d, out=ad)
        dc = d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        em1 = torch.expm1(dc)  # rho - 1
        torch.sub(em1, dc, out=k3)
        torch.add(em1, 2.0, out=chi).mul_(em1)  # rho^2 - 1 = (rho - 1)(rho + 1)
        # 0 on valid tokens (1 - 1/1), -inf elsewhere (1 - 1/+0): x + pad is x masked for a max,
        # x - pad for a min
        self._pad = torch.rsub(mf.reciprocal(), 1.0)
        self._mask_f, self._log_ratio, self._clamped, self._em1 = mf, d, dc, em1
        self._per_token = rows
        if self.fused:
            return
        self.seq_sums = rows.sum(-1)
        if m_in.shape[-1] == 0:  # no token at all: a max of nothing, without reducing an empty dim
            self.seq_max = torch.full((3, m_in.shape[0]), -math.inf, dtype=torch.float64, device=dev)
        else:  # max(-log rho) = -min(log rho), max log rho, max |dp|: one masked reduction
            self.seq_max = (rows[2:5] + self._pad).amax(-1)

    def _row_attr(self, name: str) -> Tensor:
        if not hasattr(self, "_per_token"):
            self._token_rows()
        return getattr(self, name)

    per_token = property(lambda self: self._row_attr("_per_token"))
    log_ratio = property(lambda self: self._row_attr("_log_ratio"))
    clamped = property(lambda self: self._row_attr("_clamped"))
    mask_f = property(lambda self: self._row_attr("_mask_f"))
    pad = property(lambda self: self._row_attr("_pad"))

    @functools.cached_property
    def extremes(self) -> Tensor:
        if self.seq_max.shape[-1] == 0:
            return cached_const((-math.inf,) * 3, torch.float64, self.seq_max.device)
        return self.seq_max.amax(-1)

    @functools.cached_property
    def valid(self) -> Tensor:
        """``[B]`` bool, sequences with at least one valid token."""
        return self.lens > 0

    @functools.cached_property
    def masked_log_ratio(self) -> Tensor:
        """``[B, T]`` float64 ``log rho`` on the valid tokens, 0 elsewhere: :attr:`log_ratio` on the
        PyTorch path; on the fused path two casts and a select, rather than every per-token row the C
        pass spared (padding may hold NaN/inf: selected away, never multiplied)."""
        if not self.fused:
            return self.log_ratio
        d = self.old_logprobs.to(torch.float64) - self.rollout_logprobs.to(torch.float64)
        return torch.where(self.mask, d, cached_const(0.0, torch.float64, d.device))

    @functools.cached_property
    def rho(self) -> Tensor:
        return self._row_attr("_em1") + 1.0

    def row(self, name: str) -> int:
        return self.ROWS.index(name)

    def seq_mean(self, name: str) -> Tensor:
        """``[B]`` float64 mean over each sequence's valid tokens (0 for empty sequences)."""
        return self.seq_means[self.row(name)]


def valid_mask(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]`` bool: the tokens the correction and the loss count (mask set, both log-probs finite).

    What :class:`MismatchTensors` uses on each micro-batch; a trainer computes its global
    denominators (valid tokens and sequences of the optimizer step) from it once per batch, so a
    non-finite log-prob drops its token from the denominators too, as it drops from the sums.
    """
    m = mask if mask.dtype == torch.bool else mask != 0
    return m & torch.isfinite(old_logprobs) & torch.isfinite(rollout_logprobs)
