"""ACRL's controller replayed on a logged trajectory: what Y/X, |alpha| and the largest token weight a
controller setting would have produced on the mismatch an uncorrected run saw, without training
with it. The pilot has no ACRL arm; this is how its runs inform the extension arm's setting.

Per step the logged ``mismatch/prob_abs_diff`` (token mean of |pi_old - mu|) stands in for ACRL's Y
(the sequence mean of the same distance, ``correction.distance: prob_abs``), the real
:class:`AcrlController` turns the Y series into X and Y/X, and ``|alpha|`` is the larger over both
signs of ``+-gamma (1 - Y/X)`` clipped to ``[alpha_min, alpha_max]`` (``acrl.alpha_bounds``; for the
paper's symmetric bound ``min(|gamma (1 - Y/X)|, alpha_max)``). The largest weight
``(pi_old/mu) ** alpha`` of a step is at most
``exp(|alpha| * max |log(pi_old/mu)|)`` (the logged ``mismatch/log_ratio_min`` / ``_max``; both
signs of the advantage occur in a batch), then ``weight_high``: an upper bound, not a measurement.
A step sampled at a lag below the controller's ``reference_lag`` (the logged
``async/staleness_max``, the batch's oldest token) is not measured into X, as in training. It is
open loop: a controller that trains changes the trajectory it would then see.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_acrl.config import CorrectionConfig
from megatron_acrl.correction.acrl import AcrlController, alpha_bounds

Y_KEY, LO_KEY, HI_KEY = "mismatch/prob_abs_diff", "mismatch/log_ratio_min", "mismatch/log_ratio_max"
LAG_KEY = "async/staleness_max"


@dataclass(frozen=True)
class Replay:
    """One controller setting on one trajectory: the per-step series and their extremes."""

    y_over_x: list[float]
    alpha: list[float]
    log10_weight: list[float]
    """log10 of the bound on the step's largest weight (inf where Y/X is)."""

    def summary(self) -> str:
        def mx(xs: Sequence[float]) -> float:
            return max(xs) if xs else math.nan

        big = sum(a > 1.0 for a in self.alpha)
        return (
            f"max Y/X {mx(self.y_over_x):.3g}, max |alpha| {mx(self.alpha):.3g} ({big}/{len(self.alpha)} "
            f"steps above 1), largest weight up to 1e{mx(self.log10_weight):.1f}"
        )


def replay(rows: Sequence[dict[str, Any]], cfg: CorrectionConfig, reference_lag: int = 0) -> Replay:
    """Feed ``rows`` (metrics rows in step order) to an ACRL controller with ``cfg``'s reference and
    ``reference_lag`` (the run's: ``Config.acrl_reference_lag``; a row without a logged lag counts as
    sampled at it).

    Rows without the three mismatch metrics (the eval-only rows) are skipped.
    """
    ctrl = AcrlController(cfg, reference_lag=reference_lag)
    yx, alpha, logw = [], [], []
    for r in rows:
        y, lo, hi = (r.get(k) for k in (Y_KEY, LO_KEY, HI_KEY))
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in (y, lo, hi)):
            continue
        lag = r.get(LAG_KEY)
        lag = int(lag) if isinstance(lag, int | float) else None
        sig = ctrl.update((float(y), 1.0), lag=lag)  # type: ignore[arg-type]
        ratio = 1.0 if sig.deferred else sig.y_over_x(cfg.eps)  # deferred: alpha = 0, as in training
        a = _largest_alpha(cfg.gamma * (1.0 - ratio), cfg)
        lw = a * max(abs(float(lo)), abs(float(hi))) / math.log(10.0)  # type: ignore[arg-type]
        if cfg.weight_high is not None:
            lw = min(lw, math.log10(cfg.weight_high))
        yx.append(ratio)
        alpha.append(a)
        logw.append(lw)
    return Replay(yx, alpha, logw)


def _largest_alpha(coef: float, cfg: CorrectionConfig) -> float:
    """``max |alpha|`` over both signs of the advantage, alpha = +-coef clipped as in training."""
    low, high = alpha_bounds(cfg.alpha_max, cfg.alpha_min)
    lo, hi = -math.inf if low is None else low, math.inf if high is None else high
    return max(abs(min(max(coef, lo), hi)), abs(min(max(-coef, lo), hi)))
