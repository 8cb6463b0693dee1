"""The correction work of one rollout batch, as both benchmarks time it.

Shared intermediates once; controller statistics and update, ACRL weights, every mismatch and weight
metric, and the one host synchronisation that turns them into floats. The kernel is
``cfg.kernel`` resolved for the tensors' device, as the trainer's loss adapter resolves it.
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
    fused_cpu,
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
    *,
    fused: bool | None = None,
    turn_ids: Tensor | None = None,
) -> dict[str, float]:
    """Everything the correction costs per batch (``[B, T]`` inputs); returns the final metrics.

    ``fused``: the kernel, resolved once by the caller (None: ``cfg.kernel`` for the tensors' device).
    ``turn_ids``: ``[B, T]`` agent turns (-1 off generated tokens), as the trainer hands them to the
    loss; read at ``correction.level: segment``.
    """
    if fused is None:
        fused = fused_cpu.resolve_kernel(cfg.kernel, old.device)
    shared = MismatchTensors(old, roll, mask, fused=fused)
    sig = ctl.update(acrl_discrepancy_stats(shared, cfg.distance))
    corr = compute_correction(
        cfg, shared, num_tokens=num_tokens, num_seqs=num_seqs, advantages=adv, acrl=sig, turn_ids=turn_ids
    )
    parts = {**corr.metrics, **mismatch_metrics(shared, num_tokens=num_tokens, num_seqs=num_seqs)}
    return finalize_metrics(parts)
