"""Mismatch metrics, correction weights and the ACRL controller: pure torch, no Megatron, no collectives.

Rooms: ``mismatch.py`` (the shared intermediates of one micro-batch), ``weights.py`` (the method
table and its composition), ``acrl.py`` (the ACRL formula, statistics and controller),
``step_control.py`` (the drift-budget learning-rate controller), ``metrics.py`` (partial metrics,
combined and finalised), ``fused_cpu.py`` + ``_fused_cpu.c`` (the CPU fast path and the choice of
it).
"""

from megatron_acrl.correction import fused_cpu
from megatron_acrl.correction.acrl import (
    AcrlController,
    AcrlSignal,
    acrl_alpha,
    acrl_coefficient,
    acrl_discrepancy_stats,
    sequence_discrepancy,
)
from megatron_acrl.correction.metrics import (
    combine_partials,
    finalize_metrics,
    mismatch_metrics,
    reduce_kind,
    row_sums,
    weight_metrics,
)
from megatron_acrl.correction.mismatch import MismatchTensors, valid_mask
from megatron_acrl.correction.step_control import DriftBudgetController, drift_stats
from megatron_acrl.correction.weights import METHODS, Correction, batch_weight_mean, compute_correction

__all__ = [
    "METHODS",
    "AcrlController",
    "AcrlSignal",
    "Correction",
    "DriftBudgetController",
    "MismatchTensors",
    "acrl_alpha",
    "acrl_coefficient",
    "acrl_discrepancy_stats",
    "batch_weight_mean",
    "combine_partials",
    "drift_stats",
    "compute_correction",
    "finalize_metrics",
    "fused_cpu",
    "mismatch_metrics",
    "reduce_kind",
    "row_sums",
    "sequence_discrepancy",
    "valid_mask",
    "weight_metrics",
]
