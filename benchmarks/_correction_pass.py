"""The correction work of one rollout batch, as both benchmarks time it.

Shared intermediates once; controller statistics and update, ACRL weights, every mismatch and weight
metric, and the one host synchronisation that turns them into floats.
"""

from __future__ import annotations

from torch import Tensor

from megatron_acrl.config import CorrectionConfig
from megatron_acrl.correction import (
    AcrlController,
    MismatchTensors,
    acrl_discrepancy_stats,
    compute_correction,
    finalize_metrics,
    mismatch_metrics,
)


def correction_pass(
    cfg: CorrectionConfig,
    ctl: AcrlController,
    old: Tensor,
    roll: Tensor,
    mask: Tensor,
    adv: Tensor,
    num_tokens: int,
    num_seqs: int,
) -> dict[str, float]:
    """Everything the correction costs per batch (``[B, T]`` inputs); returns the final metrics."""
    shared = MismatchTensors(old, roll, mask)
    sig = ctl.update(acrl_discrepancy_stats(None, None, None, cfg.distance, shared=shared))
    corr = compute_correction(
        cfg,
        None,
        None,
        None,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        advantages=adv,
        acrl=sig,
        shared=shared,
    )
    parts = {
        **corr.metrics,
        **mismatch_metrics(None, None, None, num_tokens=num_tokens, num_seqs=num_seqs, shared=shared),
    }
    return finalize_metrics(parts)
