"""ACRL: the weight formula, the controller's statistics and the controller itself.

ACRL (arXiv 2607.24062) weights each token's policy gradient by ``(pi_old / mu) ** alpha`` with
``alpha = gamma * sign(A) * (1 - Y / X)``: ``Y`` is the current batch's sequence-level
discrepancy between trainer (pi_old) and rollout engine (mu), ``X`` a reference measured at the
start. When the mismatch grows (Y > X) tokens are pulled back toward mu; when it shrinks (Y < X)
they are pushed away, which keeps exploration.

The formula lives here once: :func:`acrl_coefficient` (``gamma * (1 - Y / X)``, per batch or per
sequence) and :func:`acrl_alpha` (``sign(A)`` times it, bounded). The weights themselves are the
``acrl`` entry of the method table (``weights.py``); ``_fused_cpu.c``'s ``acrl_weights_pass`` is its
C twin and takes the same coefficient.

The controller holds only Python floats, so every rank can hold an identical copy: the trainer
all-reduces :func:`acrl_discrepancy_stats` over data-parallel ranks, calls
:meth:`AcrlController.update` with the reduced sums on every rank (or on one and loads the others
from :meth:`state_dict`), and checkpoints :meth:`state_dict`.

Reference modes:
- ``static`` (paper): X is the mean Y of the first ``reference_batches`` batches, then fixed.
- ``ema`` (the paper's stated future work): after those batches, each batch is controlled against
  the previous reference and then ``X_t = decay * X_{t-1} + (1 - decay) * Y_t``.
While the reference is being measured, X is the running mean of the Y seen so far, this batch's
included: the first batch therefore has Y = X and alpha = 0 (the plain loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron_acrl.config import CorrectionConfig
from megatron_acrl.correction import fused_cpu
from megatron_acrl.correction.mismatch import MismatchTensors


@dataclass(frozen=True)
class AcrlSignal:
    """What the ACRL controller hands the loss for one rollout batch (same on every rank).

    Attributes:
        x: reference sequence-level discrepancy X.
        y: this batch's sequence-level discrepancy Y.
    The control strength gamma lives in :class:`CorrectionConfig`.
    """

    x: float
    y: float

    def y_over_x(self, eps: float) -> float:
        return self.y / max(self.x, eps)


# The per-token distances Y can be the sequence mean of; each is a row of MismatchTensors.ROWS.
DISTANCES = ("prob_abs", "logprob_abs", "k3")


def _distance_row(distance: str) -> str:
    if distance not in DISTANCES:
        raise ValueError(f"correction.distance must be prob_abs, logprob_abs or k3; got {distance!r}")
    return distance


def sequence_discrepancy(sh: MismatchTensors, distance: str) -> tuple[Tensor, Tensor]:
    """Per-sequence discrepancy ``Y_i``: the mean over valid tokens of a per-token distance.

    Args:
        sh: the micro-batch's shared intermediates (log pi_old, log mu, mask, ``[B, T]``).
        distance: ``prob_abs`` (|pi_old - mu|, the paper's), ``logprob_abs`` (|log pi_old - log mu|)
            or ``k3`` (rho - 1 - log rho, rho = pi_old / mu).
    Returns:
        ``(y [B] float64, valid [B] bool)``; ``y`` is 0 for sequences with no valid token.
    """
    return sh.seq_mean(_distance_row(distance)), sh.valid


def acrl_discrepancy_stats(sh: MismatchTensors, distance: str) -> Tensor:
    """Local sufficient statistics of the batch discrepancy Y, to be all-reduced (SUM).

    Args:
        sh: the local sequences' shared intermediates. distance: as in :func:`sequence_discrepancy`.
    Returns:
        ``[2]`` float64: (sum over valid local sequences of Y_i, number of valid local sequences).
        ``Y = stats[0] / stats[1]`` after the all-reduce over data-parallel ranks.
    """
    row = _distance_row(distance)
    if sh.discrepancy is not None:  # the fused pass summed them already
        return sh.discrepancy[fused_cpu.DISCREPANCY_INDEX[row]]
    return torch.stack([sh.seq_mean(row), sh.valid_f]).sum(-1)


def acrl_coefficient(cfg: CorrectionConfig, signal: AcrlSignal, sh: MismatchTensors) -> Tensor | float:
    """``c = gamma * (1 - Y / X)``, the part of alpha that does not depend on the token.

    Args:
        cfg: gamma, eps (floor of X) and ``per_sequence_y`` / ``distance``.
        signal: the controller's X and Y of this rollout batch.
        sh: the micro-batch (read only with ``per_sequence_y``: each sequence's own ``Y_i``).
    Returns:
        A float (the batch Y), or ``[B]`` float64 (``per_sequence_y``).
    """
    if cfg.per_sequence_y:
        y_i = sh.seq_mean(_distance_row(cfg.distance))
        return cfg.gamma * (1.0 - y_i / max(signal.x, cfg.eps))
    return cfg.gamma * (1.0 - signal.y_over_x(cfg.eps))


def acrl_alpha(advantages: Tensor, coef: Tensor | float, alpha_max: float | None = None) -> Tensor:
    """``alpha = sign(A) * c`` (``c`` from :func:`acrl_coefficient`), bounded to ``|alpha| <= alpha_max``.

    Args:
        advantages: ``[B, T]`` (or ``[B, 1]``) advantages; only their sign is used.
        coef: a float or ``[B, 1]`` (one per sequence), in the weights' dtype.
    Returns:
        ``alpha`` broadcast to ``advantages``' shape.
    """
    alpha = torch.sign(advantages.detach()) * coef
    if alpha_max is not None:
        alpha = alpha.clamp(-alpha_max, alpha_max)
    return alpha


class AcrlController:
    """P-controller on the global sequence-level discrepancy.

    Args:
        cfg: correction settings (gamma, reference mode, ema_decay, reference_batches, eps).
    """

    STATE_VERSION = 1

    def __init__(self, cfg: CorrectionConfig):
        self.cfg = cfg
        self.num_updates = 0
        self.ref_sum = 0.0
        self.x: float | None = None  # reference to use for the current batch
        self.y: float | None = None  # current batch's discrepancy
        self._x_next: float | None = None  # ema: reference for the next batch

    def update(self, stats: Tensor | tuple[float, float]) -> AcrlSignal:
        """Observe one rollout batch.

        Args:
            stats: ``[2]`` globally reduced (sum of per-sequence Y_i, number of sequences).
        Returns:
            The signal for this batch (also available as :meth:`signal`).
        """
        total, count = (float(v) for v in (stats.tolist() if isinstance(stats, Tensor) else stats))
        if count <= 0:
            raise ValueError("ACRL update with no valid sequence: the rollout batch has no response tokens")
        y = total / count
        if not math.isfinite(y):
            raise ValueError(f"ACRL discrepancy is not finite (Y={y}); check the rollout log-probs")
        self.y = y
        cfg = self.cfg
        if self.num_updates < cfg.reference_batches:
            self.ref_sum += y
            self.x = self.ref_sum / (self.num_updates + 1)
            self._x_next = self.x
        elif cfg.reference == "ema":
            self.x = self._x_next
            self._x_next = cfg.ema_decay * self.x + (1.0 - cfg.ema_decay) * y  # type: ignore[operator]
        self.num_updates += 1
        return self.signal()

    def signal(self) -> AcrlSignal:
        """The (X, Y, gamma) of the latest batch; raises before the first update."""
        if self.x is None or self.y is None:
            raise RuntimeError("AcrlController.signal() before the first update(): observe a batch first")
        return AcrlSignal(x=self.x, y=self.y)

    def metrics(self) -> dict[str, float]:
        """Controller state for logging (``acrl/x``, ``acrl/y``, ``acrl/y_over_x``)."""
        if self.x is None or self.y is None:
            return {}
        return {
            "acrl/x": self.x,
            "acrl/y": self.y,
            "acrl/y_over_x": self.signal().y_over_x(self.cfg.eps),
            "acrl/gamma": self.cfg.gamma,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.STATE_VERSION,
            "num_updates": self.num_updates,
            "ref_sum": self.ref_sum,
            "x": self.x,
            "y": self.y,
            "x_next": self._x_next,
            "reference": self.cfg.reference,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"version", "num_updates", "ref_sum", "x", "y", "x_next"} - set(state)
        if missing:
            raise ValueError(
                f"ACRL controller state is missing {sorted(missing)}; not a controller checkpoint"
            )
        if state["version"] != self.STATE_VERSION:
            raise ValueError(f"ACRL controller state version {state['version']} != {self.STATE_VERSION}")
        self.num_updates = int(state["num_updates"])
        self.ref_sum = float(state["ref_sum"])
        self.x = None if state["x"] is None else float(state["x"])
        self.y = None if state["y"] is None else float(state["y"])
        self._x_next = None if state["x_next"] is None else float(state["x_next"])

    def __repr__(self) -> str:
        return f"AcrlController(x={self.x}, y={self.y}, updates={self.num_updates}, gamma={self.cfg.gamma})"
