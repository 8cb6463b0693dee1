"""The ACRL controller: a small stateful object updated once per rollout batch.

ACRL (arXiv 2607.24062) weights each token's policy gradient by ``(pi_old / mu) ** alpha`` with
``alpha = gamma * sign(A) * (1 - Y / X)``: ``Y`` is the current batch's sequence-level
discrepancy between trainer and rollout engine, ``X`` a reference measured at the start. When the
mismatch grows (Y > X) tokens are pulled back toward mu; when it shrinks (Y < X) they are pushed
away, which keeps exploration.

The controller holds only Python floats, so every rank can hold an identical copy: the trainer
all-reduces :func:`~megatron_acrl.correction.weights.acrl_discrepancy_stats` over data-parallel
ranks, calls :meth:`AcrlController.update` with the reduced sums on every rank (or on one and
broadcasts :meth:`state_dict`), and checkpoints :meth:`state_dict`.

Reference modes:
- ``static`` (paper): X is the mean Y of the first ``reference_batches`` batches, then fixed.
- ``ema`` (the paper's stated future work): after those batches, each batch is controlled against
  the previous reference and then ``X_t = decay * X_{t-1} + (1 - decay) * Y_t``.
While the reference is being measured, X is the running mean of the Y seen so far, this batch's
included: the first batch therefore has Y = X and alpha = 0 (the plain loss).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from megatron_acrl.config import CorrectionConfig
from megatron_acrl.correction.weights import AcrlSignal


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
            "acrl/y_over_x": self.y / max(self.x, self.cfg.eps),
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

    def broadcast(self, src: int, group=None) -> None:
        """Make every rank of ``group`` hold ``src``'s state (one small object broadcast)."""
        import torch.distributed as dist

        obj = [self.state_dict()]
        dist.broadcast_object_list(obj, src=src, group=group)
        self.load_state_dict(obj[0])

    def __repr__(self) -> str:
        return f"AcrlController(x={self.x}, y={self.y}, updates={self.num_updates}, gamma={self.cfg.gamma})"
