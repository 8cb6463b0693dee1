"""The exact grids' verdicts, each stated with its numbers whichever way it goes.

Every comparison pairs two arms seed by seed (same warm start, same prompts in the same order) and
gives the mean paired difference with its 95% Student's t interval (:func:`stats.paired_ci`). The
verdicts of issue #23, in its order:

1. the stress is real: uncorrected >= 0.05 below BF16 on the trainer's exact J, interval below 0;
2. ACRL beats uncorrected: the paired interval above 0;
3. ACRL is non-inferior to BF16 on the *served* exact J within 0.05: the interval's lower end > -0.05;
4. ACRL vs TIS: superior if the interval excludes 0 from above, equivalent if it lies within +-0.05;

then whether the extension arm reaches the paper's without its failures. The pilot's go / no-go
(:func:`pilot_check`) is the first verdict on the pilot's seeds, with k3 rising.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_acrl.study.exact import ExactArm
from megatron_acrl.study.stats import mean_std, paired_ci

MARGIN = 0.05
"""The margin of verdicts 1, 3 and 4 (exact J)."""


@dataclass(frozen=True)
class Paired:
    """``a`` minus ``b`` on one metric over their common seeds."""

    a: str
    b: str
    mean_a: float
    mean_b: float
    diff: float
    ci: tuple[float, float] | None
    wins: int
    """Seeds on which ``a > b``."""
    n: int

    def text(self) -> str:
        ci = f", 95% CI {self.ci[0]:+.3f} to {self.ci[1]:+.3f}" if self.ci else ", no interval (< 2 seeds)"
        return (
            f"`{self.a}` {self.mean_a:.3f} vs `{self.b}` {self.mean_b:.3f}: difference {self.diff:+.3f}"
            f"{ci}; `{self.a}` higher on {self.wins}/{self.n} seeds"
        )


def paired(a: ExactArm, b: ExactArm, metric: str) -> Paired | None:
    """``a`` vs ``b`` on ``metric`` (an :class:`ExactArm` list) over the seeds both have with a
    finite value; None when there is none."""
    va, vb = getattr(a, metric), getattr(b, metric)
    common = [
        (x, y)
        for s, x in zip(a.seeds, va, strict=True)
        if s in b.seeds and math.isfinite(x) and math.isfinite(y := vb[b.seeds.index(s)])
    ]
    if not common:
        return None
    xs, ys = [c[0] for c in common], [c[1] for c in common]
    diffs = [x - y for x, y in common]
    return Paired(
        a.arm, b.arm, mean_std(xs)[0], mean_std(ys)[0], mean_std(diffs)[0], paired_ci(diffs),
        sum(d > 0 for d in diffs), len(diffs),
    )  # fmt: skip


def _no(p: Paired | None, what: str) -> str | None:
    if p is None:
        return f"no result: no seed on which both arms of '{what}' finished"
    if p.ci is None:
        return f"no result: one common seed ({p.text()})"
    return None


def stress_is_real(bf16: ExactArm, none: ExactArm) -> tuple[bool, str]:
    """Verdict 1: uncorrected >= 0.05 below BF16 on the trainer's exact J, interval below 0."""
    p = paired(none, bf16, "j_trainer")
    if (msg := _no(p, "uncorrected vs BF16")) is not None:
        return False, msg
    assert p is not None and p.ci is not None
    ok = p.diff <= -MARGIN and p.ci[1] < 0
    if ok:
        why = f"uncorrected is {-p.diff:.3f} below BF16 and the interval excludes 0"
    elif p.ci[1] < 0:
        why = f"uncorrected is below BF16 (interval excludes 0) but by {-p.diff:.3f} < {MARGIN}"
    elif p.diff <= -MARGIN:
        why = "the mean shortfall is >= 0.05 but the interval reaches 0: these seeds do not show it"
    else:
        why = f"uncorrected is not {MARGIN} below BF16"
    return ok, f"**{'yes' if ok else 'no'}**: {why} ({p.text()})"


def beats(acrl: ExactArm, none: ExactArm) -> tuple[bool, str]:
    """Verdict 2: ACRL's paired interval over uncorrected lies above 0 (trainer's exact J)."""
    p = paired(acrl, none, "j_trainer")
    if (msg := _no(p, "ACRL vs uncorrected")) is not None:
        return False, msg
    assert p is not None and p.ci is not None
    ok = p.ci[0] > 0
    why = "the interval lies above 0" if ok else "the interval reaches 0 or below"
    return ok, f"**{'yes' if ok else 'no'}**: {why} ({p.text()})"


def noninferior(acrl: ExactArm, bf16: ExactArm) -> tuple[bool, str]:
    """Verdict 3: ACRL's served exact J is within 0.05 of BF16's (interval's lower end > -0.05)."""
    p = paired(acrl, bf16, "j_served")
    if (msg := _no(p, "ACRL vs BF16, served")) is not None:
        return False, msg
    assert p is not None and p.ci is not None
    ok = p.ci[0] > -MARGIN
    why = f"the interval's lower end {p.ci[0]:+.3f} is {'above' if ok else 'at or below'} -{MARGIN}"
    return ok, f"**{'yes' if ok else 'no'}**: {why} ({p.text()})"


def versus_tis(acrl: ExactArm, tis: ExactArm) -> tuple[str, str]:
    """Verdict 4: ``superior`` (interval above 0), ``inferior`` (below 0), ``equivalent`` (within
    +-0.05) or ``unresolved``, on the trainer's exact J."""
    p = paired(acrl, tis, "j_trainer")
    if (msg := _no(p, "ACRL vs TIS")) is not None:
        return "unresolved", msg
    assert p is not None and p.ci is not None
    lo, hi = p.ci
    if lo > 0:
        word, why = "superior", "the interval excludes 0 from above"
    elif hi < 0:
        word, why = "inferior", "the interval excludes 0 from below"
    elif lo > -MARGIN and hi < MARGIN:
        word, why = "equivalent", f"the interval lies within +-{MARGIN}"
    else:
        word, why = "unresolved", f"the interval contains 0 and reaches past +-{MARGIN}"
    return word, f"**{word}**: {why} ({p.text()})"


def extension(ext: ExactArm, paper: ExactArm) -> tuple[bool, str]:
    """The extension arm reaches the paper's arm (trainer's exact J non-inferior within 0.05) with no
    failed run or non-finite step, and its largest weight is stated beside the paper's."""
    p = paired(ext, paper, "j_trainer")
    if (msg := _no(p, "extension vs paper")) is not None:
        return False, msg
    assert p is not None and p.ci is not None
    clean = not any(ext.failed) and not any(ext.nonfinite)
    ok = p.ci[0] > -MARGIN and clean

    def troubles(a: ExactArm) -> str:
        w = [x for x in a.weight_max if math.isfinite(x)]
        return (
            f"`{a.arm}`: {sum(a.failed)} failed run(s), {sum(a.nonfinite)} non-finite step(s), largest "
            f"weight {max(w):.3g}"
            if w
            else f"`{a.arm}`: {sum(a.failed)} failed run(s)"
        )

    why = f"non-inferior within {MARGIN}" if p.ci[0] > -MARGIN else f"not shown within {MARGIN}"
    return ok, f"**{'yes' if ok else 'no'}**: {why} ({p.text()}); {troubles(ext)}; {troubles(paper)}"


def k3_rises(arm: ExactArm) -> tuple[bool, str]:
    """k3 over the last 20% of steps above its first 20%, on every seed."""
    pairs = [(a, b) for a, b in zip(arm.k3_start, arm.k3_end, strict=True) if math.isfinite(a + b)]
    ok = bool(pairs) and all(b > a for a, b in pairs)
    shown = ", ".join(f"{a:.3g} -> {b:.3g}" for a, b in pairs)
    peaks = [p for p in arm.k3_peak if math.isfinite(p)]
    peak = f" (largest 5-step mean {', '.join(f'{p:.3g}' for p in peaks)})" if peaks else ""
    word = "rising" if ok else "not rising"
    return ok, f"k3 (first -> last 20% of steps) {shown}{peak}: {word} on every seed"


def k3_peaked(arm: ExactArm, factor: float = 10.0) -> bool:
    """k3's largest 5-step mean at least ``factor`` x its first-20% mean, on every seed."""
    pairs = [(a, p) for a, p in zip(arm.k3_start, arm.k3_peak, strict=False) if math.isfinite(a + p)]
    return bool(pairs) and all(p >= factor * a for a, p in pairs)


def collapsed(arm: ExactArm) -> bool:
    """Every seed ended (last 20% of exact evals, trainer's weights) below half its step-0 exact J."""
    pairs = [(j, j0) for j, j0 in zip(arm.j_trainer, arm.j0, strict=True) if math.isfinite(j + j0)]
    return bool(pairs) and all(j < 0.5 * j0 for j, j0 in pairs)


def pilot_check(bf16: ExactArm, none: ExactArm) -> tuple[bool, str]:
    """The pilot's go / no-go: uncorrected ends >= 0.05 below BF16 on the trainer's exact J (mean
    paired shortfall: two seeds give no useful interval) with k3 rising. Where the uncorrected runs
    collapsed, k3 falls again once the dead policy stops moving: the clause is then read on k3's peak
    (:func:`k3_peaked`), and both readings are stated (docs/study/README.md, written before the
    pilot's stress arms ran)."""
    p = paired(none, bf16, "j_trainer")
    if p is None:
        return False, "**no-go**: no seed on which both pilot arms finished"
    rising, k3 = k3_rises(none)
    grew = rising
    if not rising and collapsed(none):
        grew = k3_peaked(none)
        k3 += (
            f"; the uncorrected runs collapsed (J below half its step-0 value on every seed), so the clause "
            f"is read on k3's peak: {'at least' if grew else 'not'} 10x its first 20% on every seed"
        )
    go = p.diff <= -MARGIN and grew
    return go, (
        f"**{'go' if go else 'no-go'}**: uncorrected {'is' if p.diff <= -MARGIN else 'is not'} >= {MARGIN} "
        f"below BF16 ({p.text()}); {k3}"
    )
