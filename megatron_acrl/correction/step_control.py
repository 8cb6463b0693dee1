"""The drift-budget step controller: each RL step's learning rate scaled by how far the sampler drifted.

Under staleness only the correction weight relates the update to the sampler mu (pi_old is the
trainer's own current weights, so the PPO clip spans one batch's optimizer steps only), and under
grad-clip and Adam a per-token weight re-aims a step but hardly shortens it (issue #34). This
controller shortens it: before a rollout batch's first optimizer step it sets

    s = clip(sqrt(B / D), s_min, 1),    B = max(kappa * D_ref, B_min)

with ``D`` the batch's token-mean k3 mismatch between pi_old and mu (``rho - 1 - log rho``,
``rho = pi_old / mu``) and ``D_ref`` the k3 of the first batch sampled at lag 0 (in async, of its
lag-0 tokens only), and the trainer multiplies the learning rate of every optimizer step of the
batch by ``s``. ``sqrt``: k3 is second order in the log-ratio, and a step's length is first order.
Without lag ``D`` stays near ``D_ref``, ``D <= B`` and ``s = 1``: the run is unchanged.

Like :class:`~megatron_acrl.correction.acrl.AcrlController` it holds only Python floats: the
trainer all-reduces :func:`drift_stats` (SUM) over data-parallel ranks, calls :meth:`update` with
the sums on one rank and loads the others from :meth:`state_dict`; the state is checkpointed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from megatron_acrl.config import CorrectionConfig
from megatron_acrl.correction.mismatch import MismatchTensors

__all__ = ["DriftBudgetController", "drift_stats"]


def drift_stats(sh: MismatchTensors, lag0: MismatchTensors | None) -> Tensor:
    """Local sums of the drift, to be all-reduced (SUM) over data-parallel ranks.

    Args:
        sh: the local sequences' shared intermediates (log pi_old, log mu, mask ``[B, T]``).
        lag0: the same tokens restricted to those sampled at lag 0 (the mask ``& token_versions ==
            trainer_version``), or None when the batch records no versions (then every token counts
            as lag 0 only if the batch is a lag-0 batch: the caller passes ``sh`` itself).
    Returns:
        ``[4]`` float64: (sum of k3 over valid tokens, their number, the same over the lag-0 tokens).
        ``D = s[0] / s[1]``, the lag-0 drift ``s[2] / s[3]`` after the all-reduce.
    """
    k3, n = sh.row("k3"), sh.row("mask")
    out = torch.zeros(4, dtype=torch.float64, device=sh.seq_sums.device)
    out[0], out[1] = sh.seq_sums[k3].sum(), sh.seq_sums[n].sum()
    if lag0 is not None:
        out[2], out[3] = lag0.seq_sums[k3].sum(), lag0.seq_sums[n].sum()
    return out


class DriftBudgetController:
    """The learning-rate scale of each rollout batch from its drift (module doc).

    Args:
        cfg: ``step_kappa`` (kappa), ``step_budget_min`` (B_min), ``step_scale_min`` (s_min).
    """

    STATE_VERSION = 1

    def __init__(self, cfg: CorrectionConfig) -> None:
        self.cfg = cfg
        self.num_updates = 0
        self.reference: float | None = None  # D_ref: None until a batch has lag-0 tokens
        self.drift: float | None = None  # D of the latest batch
        self.scale = 1.0

    @property
    def budget(self) -> float:
        """``B = max(kappa * D_ref, B_min)``; ``B_min`` while no lag-0 batch was seen."""
        ref = 0.0 if self.reference is None else self.reference
        return max(self.cfg.step_kappa * ref, self.cfg.step_budget_min)

    def update(self, stats: Tensor | tuple[float, float, float, float]) -> float:
        """Observe one rollout batch; returns the scale ``s`` of its optimizer steps.

        Args:
            stats: ``[4]`` globally reduced :func:`drift_stats`.
        Raises:
            ValueError: a non-finite drift (the rollout's log-probs are broken).
        """
        k3_sum, n, k3_lag0, n_lag0 = (
            float(v) for v in (stats.tolist() if isinstance(stats, Tensor) else stats)
        )
        drift = k3_sum / n if n > 0 else 0.0
        if not math.isfinite(drift):
            raise ValueError(f"step control: the drift (token-mean k3) is not finite ({drift})")
        if self.reference is None and n_lag0 > 0:  # the first batch with lag-0 tokens sets D_ref
            self.reference = k3_lag0 / n_lag0
        self.drift = drift
        b = self.budget
        # D <= B (no drift, or no tokens): the full rate; else sqrt(B / D), at least s_min
        self.scale = 1.0 if drift <= b else max(math.sqrt(b / drift), self.cfg.step_scale_min)
        self.num_updates += 1
        return self.scale

    def metrics(self) -> dict[str, float]:
        """``step_control/{scale,budget,drift,reference}`` (reference NaN until measured)."""
        if self.drift is None:
            return {}
        ref = math.nan if self.reference is None else self.reference
        return {
            "step_control/scale": self.scale,
            "step_control/budget": self.budget,
            "step_control/drift": self.drift,
            "step_control/reference": ref,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.STATE_VERSION,
            "num_updates": self.num_updates,
            "reference": self.reference,
            "drift": self.drift,
            "scale": self.scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (the knobs come from this run's config).

        Raises:
            ValueError: not a step-controller state, or of another version.
        """
        missing = {"version", "num_updates", "reference", "drift", "scale"} - set(state)
        if missing:
            raise ValueError(f"step-controller state is missing {sorted(missing)}; not its checkpoint")
        if state["version"] != self.STATE_VERSION:
            raise ValueError(f"step-controller state version {state['version']} != {self.STATE_VERSION}")
        self.num_updates = int(state["num_updates"])
        self.reference = None if state["reference"] is None else float(state["reference"])
        self.drift = None if state["drift"] is None else float(state["drift"])
        self.scale = float(state["scale"])

    def __repr__(self) -> str:
        return f"DriftBudgetController(scale={self.scale}, drift={self.drift}, reference={self.reference})"
