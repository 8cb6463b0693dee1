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
- ``static`` (paper): X is the mean Y of the first ``reference_batches`` measured batches, then fixed.
- ``ema`` (the paper's stated future work): after those batches, each batch is controlled against
  the previous reference and then ``X_t = decay * X_{t-1} + (1 - decay) * Y_t``.
While the reference is being measured, X is the running mean of the measured Y so far, this batch's
included: the first measured batch therefore has Y = X and alpha = 0 (the plain loss).

A batch is *measured* when its Y is at least ``correction.reference_min`` (:func:`reference_floor`);
until one is, the reference is deferred and alpha = 0. X is floored at the same value where it is
used. With ``reference_min = 0`` this is the paper's law as written: a first batch without mismatch
gives X = 0 and every later Y/X = Y/eps, with 38% of the tokens' weights cut at e^+-20 in a numpy
model of the loop. The weights' saturated fraction (``acrl/saturated_frac``) and range are reported
and :meth:`AcrlController.check_weights` warns when they trip. The controller's state records the
distance and the reference mode it measured X with, and a resume with others is refused
(``correction.remeasure_reference_on_resume`` measures a new X instead).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron_acrl.config import ConfigError, CorrectionConfig
from megatron_acrl.correction import fused_cpu
from megatron_acrl.correction.mismatch import LOG_RATIO_BOUND, MismatchTensors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AcrlSignal:
    """What the ACRL controller hands the loss for one rollout batch (same on every rank).

    Attributes:
        x: reference sequence-level discrepancy X (floored at ``correction.reference_min``).
        y: this batch's sequence-level discrepancy Y.
        deferred: no batch has been measurable yet, so there is no reference: alpha = 0.
    The control strength gamma lives in :class:`CorrectionConfig`.
    """

    x: float
    y: float
    deferred: bool = False

    def y_over_x(self, eps: float) -> float:
        return self.y / max(self.x, eps)


# The per-token distances Y can be the sequence mean of; each is a row of MismatchTensors.ROWS.
DISTANCES = ("prob_abs", "logprob_abs", "k3")

REFERENCE_MIN = {"prob_abs": 1e-5, "logprob_abs": 1e-5, "k3": 1e-10}
"""The default ``correction.reference_min`` per distance: 10-100x the float32 resolution of the
log-probs (a relative 6e-8 of |log p| <~ 16 rounds log rho by <~ 1e-6, and |pi - mu| <= |log rho|;
k3 ~ (log rho)^2 / 2), and below any real mismatch: bf16 rollouts differ by |log rho| ~ 1e-3 - 1e-2,
and even a random-init model whose tokens have p ~ 1/vocab (|pi - mu| ~ p |log rho|) stays above."""


def reference_floor(cfg: CorrectionConfig) -> float:
    """``correction.reference_min``, or the distance's default (:data:`REFERENCE_MIN`) when null."""
    if cfg.reference_min is not None:
        return cfg.reference_min
    return REFERENCE_MIN[_distance_row(cfg.distance)]


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
    r, n = sh.row(row), sh.row("mask")
    # rows r and n of the means, as one strided view (the mean of the mask row is 1 for a valid
    # sequence, 0 for an empty one): one reduction, no stack
    return sh.seq_means[r : n + 1 : n - r].sum(-1)


def acrl_coefficient(cfg: CorrectionConfig, signal: AcrlSignal, sh: MismatchTensors) -> Tensor | float:
    """``c = gamma * (1 - Y / X)``, the part of alpha that does not depend on the token.

    Args:
        cfg: gamma, eps (floor of X) and ``per_sequence_y`` / ``distance``.
        signal: the controller's X and Y of this rollout batch.
        sh: the micro-batch (read only with ``per_sequence_y``: each sequence's own ``Y_i``).
    Returns:
        A float (the batch Y), or ``[B]`` float64 (``per_sequence_y``); 0 while the reference is
        deferred.
    """
    if signal.deferred:  # no reference yet: the plain loss
        return 0.0
    if cfg.per_sequence_y:
        y_i = sh.seq_mean(_distance_row(cfg.distance))
        return cfg.gamma * (1.0 - y_i / max(signal.x, cfg.eps))
    return cfg.gamma * (1.0 - signal.y_over_x(cfg.eps))


def alpha_bounds(alpha_max: float | None, alpha_min: float | None) -> tuple[float | None, float | None]:
    """``(low, high)`` of alpha: ``[alpha_min, alpha_max]``; with ``alpha_min`` None the paper's
    symmetric ``[-alpha_max, alpha_max]`` (None: no bound on that side)."""
    low = alpha_min if alpha_min is not None else (None if alpha_max is None else -alpha_max)
    return low, alpha_max


def acrl_alpha(
    advantages: Tensor, coef: Tensor | float, alpha_max: float | None = None, alpha_min: float | None = None
) -> Tensor:
    """``alpha = sign(A) * c`` (``c`` from :func:`acrl_coefficient`), clipped to ``[low, high]``.

    The bounds are :func:`alpha_bounds`: ``[alpha_min, alpha_max]``, or ``[-alpha_max, alpha_max]``
    when ``alpha_min`` is None (the paper's law when both are None). ``alpha_min = 0`` is sign-safe
    ACRL: the weight ``rho ** alpha`` never inverts the importance weight.

    Args:
        advantages: ``[B, T]`` (or ``[B, 1]``) advantages; only their sign is used (``torch.sign``
            of NaN is 0, as in the fused kernel: a NaN advantage on padding reaches no weight).
        coef: a float or ``[B, 1]`` float64 (one per sequence).
        alpha_max / alpha_min: the bounds (None: none on that side, as above).
    Returns:
        ``alpha`` float64, broadcast to ``advantages``' shape (the sign is exact in any dtype, so the
        product is the float64 ``coef`` itself; the fused kernel computes it in float32).
    """
    alpha = torch.sign(advantages.detach()).to(torch.float64) * coef
    low, high = alpha_bounds(alpha_max, alpha_min)
    if low is not None or high is not None:
        alpha = alpha.clamp(low, high)
    return alpha


class AcrlController:
    """P-controller on the global sequence-level discrepancy.

    Args:
        cfg: correction settings (gamma, reference mode, ema_decay, reference_batches, reference_min,
            warn_weight, eps, distance).
    """

    STATE_VERSION = 2

    def __init__(self, cfg: CorrectionConfig, reference_lag: int = 0):
        self.cfg = cfg
        self.reference_lag = reference_lag  # batches sampled at a smaller lag are not measured into X
        self.floor = reference_floor(cfg)
        self.num_updates = 0
        self._reset_reference()
        self.y: float | None = None  # current batch's discrepancy
        self._warned_at = -1  # the update whose weights were warned about

    def _reset_reference(self) -> None:
        self.ref_count = 0  # batches measured into the reference
        self.ref_sum = 0.0
        self.x: float | None = None  # reference for the current batch (None: deferred)
        self._x_next: float | None = None  # reference for the next batch

    def update(self, stats: Tensor | tuple[float, float], lag: int | None = None) -> AcrlSignal:
        """Observe one rollout batch.

        Args:
            stats: ``[2]`` globally reduced (sum of per-sequence Y_i, number of sequences).
            lag: the batch's sampling lag (trainer version minus its oldest token's weight version);
                below ``reference_lag`` the batch is not measured into the reference. None: unknown
                (a recording without versions), measured.
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
        if self.ref_count < cfg.reference_batches:
            at_lag = lag is None or lag >= self.reference_lag  # sampled at the run's own lag
            if y >= self.floor and at_lag:  # measurable: into the reference (until then, X stays None)
                self.ref_sum += y
                self.ref_count += 1
                self._x_next = self.ref_sum / self.ref_count
            self.x = self._x_next
        elif cfg.reference == "ema":
            self.x = self._x_next
            self._x_next = cfg.ema_decay * self.x + (1.0 - cfg.ema_decay) * y  # type: ignore[operator]
        self.num_updates += 1
        return self.signal()

    def signal(self) -> AcrlSignal:
        """The (X, Y) of the latest batch, X floored at ``reference_min``; raises before the first update."""
        if self.y is None:
            raise RuntimeError("AcrlController.signal() before the first update(): observe a batch first")
        if self.x is None:
            return AcrlSignal(x=self.floor, y=self.y, deferred=True)
        return AcrlSignal(x=max(self.x, self.floor), y=self.y)

    def metrics(self) -> dict[str, float]:
        """Controller state for logging (``acrl/x``, ``acrl/y``, ``acrl/y_over_x``,
        ``acrl/reference_deferred``, ``acrl/gamma``); ``acrl/x`` is the floored X in use."""
        if self.y is None:
            return {}
        sig = self.signal()
        out = {"acrl/y": self.y, "acrl/gamma": self.cfg.gamma, "acrl/reference_deferred": float(sig.deferred)}
        if not sig.deferred:
            out.update({"acrl/x": sig.x, "acrl/y_over_x": sig.y_over_x(self.cfg.eps)})
        return out

    def check_weights(self, metrics: Mapping[str, float]) -> str | None:
        """Warn (once per rollout batch) when a step's weights saturate or leave the warning band.

        Args:
            metrics: a step's final metrics (``acrl/saturated_frac``, ``correction/weight_max``,
                ``correction/weight_min``).
        Returns:
            The warning logged, or None.
        """
        trips = []
        sat = metrics.get("acrl/saturated_frac", 0.0)
        if sat > 0:
            trips.append(f"{sat:.2%} of the tokens have their weight cut at e^+-{LOG_RATIO_BOUND:g}")
        hi, lo = (
            metrics.get("correction/weight_max", math.nan),
            metrics.get("correction/weight_min", math.nan),
        )
        warn = self.cfg.warn_weight
        if hi > warn or lo < 1.0 / warn:
            trips.append(f"weights reach [{lo:.3g}, {hi:.3g}], beyond [1/{warn:g}, {warn:g}]")
        if not trips or self._warned_at == self.num_updates:
            return None
        self._warned_at = self.num_updates
        sig = self.signal()
        msg = (
            f"ACRL: {'; '.join(trips)} (Y/X = {sig.y_over_x(self.cfg.eps):.3g}, X = {sig.x:.3g}, "
            f"Y = {sig.y:.3g}, gamma = {self.cfg.gamma:g}). The paper's law rho^(gamma sign(A) (1 - Y/X)) "
            "is unbounded when Y >> X: bound it (correction.alpha_max, correction.weight_high), lower "
            "correction.gamma, let X follow the mismatch (correction.reference=ema), or raise "
            "correction.reference_min if X was measured from a batch with almost no mismatch"
        )
        log.warning(msg)
        return msg

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.STATE_VERSION,
            "num_updates": self.num_updates,
            "ref_count": self.ref_count,
            "ref_sum": self.ref_sum,
            "x": self.x,
            "y": self.y,
            "x_next": self._x_next,
            "reference": self.cfg.reference,
            "distance": self.cfg.distance,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; refuses one measured with another distance or reference mode.

        Raises:
            ConfigError: ``correction.distance`` or ``correction.reference`` differs from the saved
                one, and ``correction.remeasure_reference_on_resume`` is not set.
            ValueError: not a controller state, or of another version.
        """
        missing = {"version", "num_updates", "ref_sum", "x", "y", "x_next"} - set(state)
        if missing:
            raise ValueError(
                f"ACRL controller state is missing {sorted(missing)}; not a controller checkpoint"
            )
        if state["version"] not in (1, self.STATE_VERSION):
            raise ValueError(f"ACRL controller state version {state['version']} != {self.STATE_VERSION}")
        self.num_updates = int(state["num_updates"])
        self.y = None if state["y"] is None else float(state["y"])
        if self.cfg.remeasure_reference_on_resume:
            self._reset_reference()
            log.warning("ACRL: correction.remeasure_reference_on_resume: measuring a new reference X")
            return
        self._check_resume(state)
        self.ref_sum = float(state["ref_sum"])
        # version 1 measured every batch: its count of measured batches is its count of updates
        self.ref_count = int(state.get("ref_count", min(self.num_updates, self.cfg.reference_batches)))
        self.x = None if state["x"] is None else float(state["x"])
        self._x_next = None if state["x_next"] is None else float(state["x_next"])

    def _check_resume(self, state: dict[str, Any]) -> None:
        """A reference X is only meaningful against a Y of the same distance and mode."""
        errors = []
        for key in ("distance", "reference"):
            saved, now = state.get(key), getattr(self.cfg, key)
            if saved is None:  # a version-1 state does not record its distance
                log.warning("ACRL: the checkpoint does not record correction.%s; assuming %r", key, now)
            elif saved != now:
                errors.append(
                    (
                        f"correction.{key}",
                        f"the checkpoint's ACRL reference X was measured with {key}={saved!r}, this run "
                        f"has {now!r}, and X is not comparable with the new Y: set correction.{key}="
                        f"{saved} to resume as it was, or correction.remeasure_reference_on_resume=true "
                        "to measure a new X",
                    )
                )
        if errors:
            raise ConfigError(errors)

    def __repr__(self) -> str:
        return f"AcrlController(x={self.x}, y={self.y}, updates={self.num_updates}, gamma={self.cfg.gamma})"
