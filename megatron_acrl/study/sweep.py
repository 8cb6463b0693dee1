"""Issue #34's lag sweep: its computed verdicts, ``reward - served J`` per arm and the pick table.

An arm's *lag* is its ``rollout.weight_lag_steps`` and its *kind* is read from its config
(:func:`arm_kind`): ``bf16`` (no quantization, no correction), ``none``, ``tis``, ``acrl`` (the
paper's law), ``acrl_ext`` (bounded), ``safe`` (sign-safe: ``alpha_min`` set), plus ``+step``
(``correction.step_control: drift_budget``) and ``+dual`` (``algorithm.dual_clip``). The verdicts
pair arms by seed on the trainer's exact J (:func:`~megatron_acrl.study.verdicts.paired`), as the
grid file pre-registers them (its ``verdicts`` key, printed first).
"""

from __future__ import annotations

import math

from megatron_acrl.config import Config
from megatron_acrl.study.exact import ExactArm
from megatron_acrl.study.grid import Grid
from megatron_acrl.study.stats import mean_std
from megatron_acrl.study.verdicts import MARGIN, paired

SIMPLICITY = ("none", "tis", "acrl_ext", "safe", "acrl", "tis+step", "safe+step", "acrl_ext+step")
"""The pick table's tie order: the simplest first (no knob, then a weight, then the controller)."""
GAP_TO_BF16 = 0.10
UNSTABLE_GRAD = 1e3
"""A step whose pre-clip grad norm exceeds this is a sign of a run going unstable."""


def arm_kind(cfg: Config) -> str:
    """The arm's kind (module doc) from its config."""
    c = cfg.correction
    if c.method == "acrl":
        kind = "safe" if c.alpha_min is not None else ("acrl_ext" if c.alpha_max is not None else "acrl")
    elif c.method == "none" and cfg.rollout.quantization == "none":
        kind = "bf16"
    else:
        kind = c.method
    if c.step_control == "drift_budget":
        kind += "+step"
    if cfg.algorithm.dual_clip is not None:
        kind += "+dual"
    return kind


def cells(grid: Grid, arms: list[ExactArm]) -> dict[tuple[int, str], ExactArm]:
    """``(lag, kind) -> arm`` (the first arm of a cell when several share it)."""
    out: dict[tuple[int, str], ExactArm] = {}
    for a in arms:
        cfg = grid.configs[a.arm]
        out.setdefault((cfg.rollout.weight_lag_steps, arm_kind(cfg)), a)
    return out


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return mean_std(xs)[0] if xs else math.nan


def reward_minus_served(arms: list[ExactArm]) -> list[str]:
    """``reward - served J`` per arm (mean over seeds of the per-seed difference): a reward the
    first-number rule pays for junk after the answer shows as a large positive value."""
    lines = []
    for a in arms:
        diffs = [r - j for r, j in zip(a.reward, a.j_served, strict=True) if math.isfinite(r - j)]
        lines.append(f"- `{a.arm}`: reward - served J = {_mean(diffs):+.3f} (reward {_mean(a.reward):.3f})")
    return lines


def unstable(a: ExactArm) -> bool:
    """A failed run, or more than 1% of the steps with a pre-clip grad norm above 1e3."""
    norms = [r["grad_norm"] for rows in a.rows for r in rows if isinstance(r.get("grad_norm"), int | float)]
    big = sum(not (n <= UNSTABLE_GRAD) for n in norms)  # a NaN norm counts as big
    return any(a.failed) or (bool(norms) and big > 0.01 * len(norms))


def scale_one_frac(a: ExactArm) -> float:
    """The fraction of the arm's steps whose ``step_control/scale`` is 1 (NaN if never logged)."""
    s = [
        r["step_control/scale"]
        for rows in a.rows
        for r in rows
        if isinstance(r.get("step_control/scale"), int | float)
    ]
    return sum(v == 1.0 for v in s) / len(s) if s else math.nan


def pick_table(grid: Grid, arms: list[ExactArm]) -> list[str]:
    """Per lag: the arm to use, the highest J among arms not worse than TIS by more than 0.05 (paired
    mean difference), ties (within 0.005) to the simplest; unstable arms are marked and not picked."""
    by = cells(grid, arms)
    lines = ["| lag | pick | exact J | candidates (J; unstable marked) |", "|---|---|---|---|"]
    for lag in sorted({lag for lag, _ in by}):
        here = {k: a for (lg, k), a in by.items() if lg == lag and k != "bf16"}
        if not here:  # (BF16 sync alone: the reference, not a pick)
            continue
        tis = here.get("tis")
        ok = []
        for k, a in here.items():
            p = paired(a, tis, "j_trainer") if tis is not None and a is not tis else None
            if not unstable(a) and (p is None or p.diff >= -MARGIN):
                ok.append((k, a))
        best = max((_mean(a.j_trainer) for _, a in ok), default=math.nan)
        ties = [(k, a) for k, a in ok if _mean(a.j_trainer) >= best - 0.005]
        ties.sort(key=lambda ka: SIMPLICITY.index(ka[0]) if ka[0] in SIMPLICITY else len(SIMPLICITY))
        cand = ", ".join(
            f"{k} {_mean(a.j_trainer):.3f}{' (unstable)' if unstable(a) else ''}" for k, a in here.items()
        )
        pick = f"`{ties[0][1].arm}` ({ties[0][0]})" if ties else "-"
        lines.append(f"| {lag} | {pick} | {best:.3f} | {cand} |")
    return lines


def computed_verdicts(grid: Grid, arms: list[ExactArm]) -> list[str]:
    """The pre-registered verdicts' numbers, each with its interval and wins whichever way it goes."""
    by = cells(grid, arms)
    out = []

    def pair(a: tuple[int, str], b: tuple[int, str], what: str) -> None:
        if a in by and b in by and (p := paired(by[a], by[b], "j_trainer")) is not None:
            out.append(f"- {what}: {p.text()}")
        else:
            out.append(f"- {what}: no result (an arm has no finished run)")

    pair((8, "tis+step"), (8, "tis"), "step control beats TIS at lag 8 (interval above 0)")
    pair(
        (8, "tis+step"),
        (0, "bf16"),
        f"step control within {GAP_TO_BF16} of BF16 sync at lag 8 (lower end > -0.10)",
    )
    pair((8, "safe+step"), (8, "tis"), "sign-safe ACRL + step control vs TIS at lag 8")
    free = [scale_one_frac(a) for (lag, k), a in by.items() if lag == 0 and k.endswith("+step")]
    out.append(f"- step control is free without lag (s = 1 on >= 95% of steps): {[f'{f:.1%}' for f in free]}")
    worse = []
    for lag in sorted({lag for lag, _ in by}):
        if (lag, "acrl_ext") in by and (lag, "tis") in by:
            p = paired(by[(lag, "acrl_ext")], by[(lag, "tis")], "j_trainer")
            if p is not None and p.ci is not None and p.ci[1] < 0:
                worse.append(lag)
    out.append(
        "- smallest lag at which ACRL-ext is worse than TIS (interval below 0): "
        f"{min(worse) if worse else 'none'}"
    )
    pair((8, "safe+step"), (8, "acrl_ext"), "sign-safe ACRL + step control vs ACRL-ext at lag 8")
    return out


def section(grid: Grid, arms: list[ExactArm]) -> list[str]:
    """The sweep's report block: the pick table first (what a reader came for), then the
    pre-registered verdicts, their numbers and reward - served J."""
    lines = ["### Pick table: which correction to use at each lag", "", *pick_table(grid, arms), ""]
    lines += ["### Pre-registered verdicts (written into the grid file before it ran)", ""]
    lines += [f"{i}. {' '.join(v.split())}" for i, v in enumerate(grid.verdicts, 1)] + [""]
    lines += [
        "### The verdicts' numbers (trainer's exact J, paired by seed)",
        "",
        *computed_verdicts(grid, arms),
        "",
    ]
    lines += ["### Reward minus served exact J (a reward-hacking flag)", "", *reward_minus_served(arms), ""]
    return lines
