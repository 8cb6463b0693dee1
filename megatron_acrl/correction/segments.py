"""Per-turn ("segment") units of the sequence-level corrections: ``correction.level: segment``.

An agent's trajectory is one row of many turns; a sequence-level ratio over all of it lets one bad
turn clip or drop the whole trajectory (and over thousands of tokens its product leaves every
floating-point range). At segment level the unit of ``seq_tis``, ``seq_mis``, ``geo_mis``, the extra
masks and the veto is a *segment*: the valid tokens of one row that one turn generated (the batch's
``turn_ids``, -1 off generated tokens; ROLL's ``segment`` weight type).

:class:`Segments` holds the per-segment sums those methods read, gathered back onto each token, so a
segment method is the sequence method with ``[B, 1]`` replaced by ``[B, T]``. Everything stays in log
space, in float64: a segment's ratio is ``exp(sum log rho)`` only after its clamp to the method's band
(and to ``+-LOG_RATIO_BOUND``), never a product of per-token ratios.

Pure torch; runs on the PyTorch path on both kernels (the fused C pass has no segment loop: its
per-sequence sums are of no use here, and the segment sums are two ``index_add`` of ``[B, T]``).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from megatron_acrl.correction.mismatch import MismatchTensors


class Segments:
    """The segments of one micro-batch and the sums of their log-ratios.

    A segment is a (row, turn) pair with at least one valid token; tokens of one turn need not be
    contiguous (they are, in an agent's trajectory). A sequence-level run over the same tokens is a
    segment-level run whose every valid token has turn 0.

    Args:
        sh: the micro-batch's shared intermediates (its valid tokens and log rho).
        turn_ids: ``[B, T]`` integer (or integer-valued float) turn of each token; any value off the
            valid tokens (-1 on prompt, observation and padding).

    Attributes:
        index: ``[B, T]`` int64 segment of each token, ``row * K + turn`` (K turns at most per row);
            turn 0's segment off the valid tokens (never read there).
        log_ratio: ``[B, T]`` float64, on each valid token the sum of ``log rho`` over its segment;
            0 elsewhere.
        count: ``[B, T]`` float64, on each valid token the number of valid tokens in its segment;
            0 elsewhere.

    Raises:
        ValueError: ``turn_ids`` not ``[B, T]``, or negative on a valid token (a trained token that
            no turn generated: the batch's ``turn_ids`` and ``loss_mask`` disagree).
    """

    def __init__(self, sh: MismatchTensors, turn_ids: Tensor):
        mask = sh.mask
        if tuple(turn_ids.shape) != tuple(mask.shape):
            raise ValueError(
                f"turn_ids of shape {tuple(turn_ids.shape)} do not match the log-probs' {tuple(mask.shape)}: "
                "pass the micro-batch's own turn_ids ([B, T], -1 off generated tokens)"
            )
        turns = turn_ids.detach().to(device=mask.device, dtype=torch.int64)
        valid_turns = torch.where(mask, turns, 0)
        if bool((valid_turns < 0).any()):
            raise ValueError(
                "turn_ids is negative on a trained token (loss_mask 1, finite log-probs): every trained "
                "token must carry the turn that generated it; the batch's turn_ids and loss_mask disagree"
            )
        self._sh = sh
        b = mask.shape[0]
        k = int(valid_turns.max()) + 1 if valid_turns.numel() else 1
        self.num_units = b * k
        self.index = valid_turns + torch.arange(b, device=mask.device).unsqueeze(-1) * k
        self._mask_f = mask.to(torch.float64)
        d = sh.masked_log_ratio
        self.log_ratio = self.gather(self.unit_sums(d))
        self.count = self.gather(self.unit_sums(self._mask_f))

    def unit_sums(self, rows: Tensor) -> Tensor:
        """``[B * K]`` float64 sums of a ``[B, T]`` row (0 off the valid tokens) over each segment."""
        out = torch.zeros(self.num_units, dtype=torch.float64, device=rows.device)
        return out.index_add_(0, self.index.reshape(-1), rows.reshape(-1).to(torch.float64))

    def gather(self, per_unit: Tensor) -> Tensor:
        """``[B * K]`` per-segment values -> ``[B, T]`` float64 on each valid token (0 elsewhere)."""
        return per_unit[self.index] * self._mask_f

    @functools.cached_property
    def mean_log_ratio(self) -> Tensor:
        """``[B, T]`` float64 mean ``log rho`` over each valid token's segment (0 elsewhere)."""
        return self.log_ratio / self.count.clamp_min(1.0)

    def any(self, flags: Tensor) -> Tensor:
        """``[B, T]`` bool: whether any valid token of the token's segment has ``flags`` set (False
        off the valid tokens)."""
        hits = self.gather(self.unit_sums(flags & self._sh.mask))
        return hits > 0

    def vetoed(self, threshold: float) -> Tensor:
        """``[B, T]`` bool: the segment holds a token with ``rho < threshold`` (the veto, per turn)."""
        return self.any(self._sh.masked_log_ratio < math.log(threshold))


def segments_of(sh: MismatchTensors, turn_ids: Tensor | None) -> Segments | None:
    """:class:`Segments` of ``turn_ids``, or None without them (a single-turn batch: each sequence is
    its one segment, and the sequence-level code is exact)."""
    return None if turn_ids is None else Segments(sh, turn_ids)
