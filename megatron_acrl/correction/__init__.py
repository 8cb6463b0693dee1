"""Mismatch metrics, correction weights and the ACRL controller: pure torch, no Megatron import."""

from megatron_acrl.correction import fused_cpu
from megatron_acrl.correction.acrl import AcrlController
from megatron_acrl.correction.metrics import (
    MismatchTensors,
    all_reduce_partials,
    combine_partials,
    finalize_metrics,
    mismatch_metrics,
    reduce_kind,
    row_sums,
    weight_metrics,
)
from megatron_acrl.correction.weights import (
    AcrlSignal,
    Correction,
    acrl_alpha,
    acrl_discrepancy_stats,
    compute_correction,
    sequence_discrepancy,
)

__all__ = [
    "AcrlController",
    "AcrlSignal",
    "MismatchTensors",
    "Correction",
    "acrl_alpha",
    "acrl_discrepancy_stats",
    "all_reduce_partials",
    "combine_partials",
    "compute_correction",
    "finalize_metrics",
    "fused_cpu",
    "mismatch_metrics",
    "reduce_kind",
    "row_sums",
    "sequence_discrepancy",
    "weight_metrics",
]
