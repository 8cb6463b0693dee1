"""Mutation testing of the pure math: ``make mutate`` (``python scripts/mutate.py [--max-children N]``).

Runs ``mutmut`` (configured in ``pyproject.toml``, ``[tool.mutmut]``: ``megatron_acrl/correction/``,
``losses.py`` and ``advantages.py``, against the fast pure tests) and scores the result:

    mutation score = killed / (mutants - equivalent)

A mutant is killed when a test fails on it (or it times out). Equivalent mutants -- a change no
input can observe, e.g. a clamp bound that cannot be reached -- are listed, each with its reason,
in the table of ``docs/correction.md`` under "Equivalent mutants"; every other survivor is printed
here to be killed or explained. The last line is ``mutation score: X``; the exit status is 1 when
X is below the goal (0.9).

``--only GLOB`` (repeatable) narrows a run to the mutants whose names match (fnmatch, as mutmut's own
``mutmut run NAME...``), e.g. the segment-level correction (``--only segment``, a shorthand for
:data:`SCOPES` ``["segment"]``); the score is then that scope's, and the survivors' report goes to
``mutants/survivors.md`` unless ``--report`` says where (``docs/mutation_survivors.md`` is the full run's).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "correction.md"
REPORT = ROOT / "docs" / "mutation_survivors.md"
GOAL = 0.9
KILLED = {"killed", "timeout", "caught by type check", "segfault", "crashed"}
SCOPES = {
    # correction.level: segment -- the Segments sums (segments.py) and the per-turn methods, keeps and
    # composition in weights.py (_seg_tis, _seg_mis, _seg_geo_mis, seg_mis_keep, seg_geo_keep,
    # _segment_keep)
    "segment": ["megatron_acrl.correction.segments.*", "megatron_acrl.correction.weights.x_*seg*"],
}
"""Named ``--only`` scopes: mutant-name globs."""


def scope_globs(only: list[str]) -> list[str]:
    """The mutant-name globs of ``--only`` arguments (a name in :data:`SCOPES` stands for its globs)."""
    return [g for arg in only for g in SCOPES.get(arg, [arg])]


def in_scope(statuses: dict[str, str], globs: list[str]) -> dict[str, str]:
    """The statuses of the mutants matching any of ``globs`` (all of them without globs)."""
    if not globs:
        return statuses
    return {k: v for k, v in statuses.items() if any(fnmatch.fnmatchcase(k, g) for g in globs)}


def equivalent_mutants(doc: Path = DOCS) -> dict[str, str]:
    """``{mutant name: reason}`` from the "Equivalent mutants" table of ``doc``."""
    text = doc.read_text()
    start = text.find("Equivalent mutants")
    if start < 0:
        return {}
    out = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        m = re.match(r"\|\s*`([^`]+)`\s*\|\s*(.*?)\s*\|\s*$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def mutant_statuses(mutmut: str) -> dict[str, str]:
    """``{mutant name: status}`` of the last run, from ``mutmut results --all true``."""
    res = subprocess.run(
        [mutmut, "results", "--all", "true"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    statuses = {}
    for line in res.stdout.splitlines():
        m = re.match(r"\s+(\S+): (.+)$", line)
        if m:
            statuses[m.group(1)] = m.group(2).strip()
    return statuses


def score(statuses: dict[str, str], equivalent: dict[str, str]) -> tuple[float, list[str], list[str]]:
    """``(score, survivors not listed as equivalent, listed names mutmut did not make)``."""
    counted = {k: v for k, v in statuses.items() if k not in equivalent and v != "skipped"}
    killed = sum(v in KILLED for v in counted.values())
    survivors = sorted(k for k, v in counted.items() if v not in KILLED)
    stale = sorted(set(equivalent) - set(statuses))
    return (killed / len(counted) if counted else 0.0), survivors, stale


def recheck_suspicious(statuses: dict[str, str]) -> dict[str, str]:
    """Run each "suspicious" mutant's tests again, alone; a run that fails or crashes kills it.

    mutmut calls a test run that ends by a signal it has no name for "suspicious": SIGABRT among
    them, which is how glibc ends a process whose heap a mutant corrupted (a C pass writing doubles
    past a float32 buffer). Such a run did not pass, like a segfault (which mutmut counts as killed).
    """
    stats = json.loads((ROOT / "mutants" / "mutmut-stats.json").read_text())
    tests_by_function = stats["tests_by_mangled_function_name"]
    out = dict(statuses)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for name in sorted(k for k, v in statuses.items() if v == "suspicious"):
        tests = sorted(tests_by_function.get(name.rpartition("__mutmut_")[0], []))
        if not tests:
            continue
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
        cmd += ["--hypothesis-profile=mutate", *tests]
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT / "mutants", env={**env, "MUTANT_UNDER_TEST": name}, capture_output=True,
                timeout=900, check=False,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 0  # still undecided: stays suspicious
        if rc == 1:
            out[name] = "killed"
        elif rc < 0 or rc >= 128:  # ended by a signal (the shell's 128 + N, or -N)
            out[name] = "crashed"
        print(f"rechecked {name}: exit {rc} -> {out[name]}")
    return out


def mutant_change(mutmut: str, name: str) -> list[str]:
    """The lines ``name`` changes (``-`` old, ``+`` new), from ``mutmut show``."""
    res = subprocess.run([mutmut, "show", name], cwd=ROOT, capture_output=True, text=True, check=False)
    return [
        line.rstrip()
        for line in res.stdout.splitlines()
        if line[:1] in "-+" and not line.startswith(("---", "+++"))
    ]


def function_of(name: str) -> str:
    """``megatron_acrl.algo.losses.x_aggregate__mutmut_3`` -> ``megatron_acrl.algo.losses.aggregate``
    (a method: ``...xǁMismatchTensorsǁ_token_rows__mutmut_5`` -> ``...MismatchTensors._token_rows``)."""
    module, _, mangled = name.partition("__mutmut_")[0].rpartition(".")
    if mangled.startswith("xǁ"):
        cls, _, meth = mangled[2:].partition("ǁ")
        return f"{module}.{cls}.{meth}"
    return f"{module}.{mangled[2:]}"


def write_report(
    mutmut: str, survivors: list[str], statuses: dict[str, str], value: float, path: Path
) -> None:
    """Every survivor and the lines it changes, grouped by function, into ``path`` (markdown); the
    reasons per function are in docs/correction.md ("Survivors")."""
    by_function: dict[str, list[str]] = {}
    for name in survivors:
        by_function.setdefault(function_of(name), []).append(name)
    out = [
        "# Mutation testing: the survivors of the last full run",
        "",
        f"Written by `make mutate` (`scripts/mutate.py`): mutation score {value:.4f}, {len(survivors)} "
        "survivors not listed as equivalent, grouped by function (most first), each with the lines it "
        'changes. Why each group survives: docs/correction.md, "Survivors".',
    ]
    for func, names in sorted(by_function.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        out += ["", f"## `{func}` ({len(names)})", ""]
        for name in sorted(names, key=lambda n: int(n.rpartition("_")[2])):
            out.append(f"- `{name.rpartition('__mutmut_')[2]}` ({statuses[name]})")
            out += [f"  `{line[:1]} {line[1:].strip()}`" for line in mutant_change(mutmut, name)]
    path.write_text("\n".join(out) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 2, help="mutants tested at once")
    ap.add_argument("--keep", action="store_true", help="reuse mutants/ of an earlier run (mutmut's cache)")
    ap.add_argument("--score-only", action="store_true", help="score the results in mutants/ without running")
    ap.add_argument("--report", type=Path, default=None, help="where the survivors' list is written")
    ap.add_argument(
        "--only", action="append", default=[], metavar="GLOB",
        help=f"only the mutants matching GLOB (repeatable; named scopes: {', '.join(SCOPES)})",
    )  # fmt: skip
    args = ap.parse_args()
    globs = scope_globs(args.only)
    report = args.report or (ROOT / "mutants" / "survivors.md" if globs else REPORT)
    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or "mutmut"
    if not args.score_only:
        if not args.keep:
            shutil.rmtree(ROOT / "mutants", ignore_errors=True)
        # one thread per test process: mutmut runs --max-children of them at once
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cmd = [mutmut, "run", "--max-children", str(args.max_children), *globs]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    every = in_scope(mutant_statuses(mutmut), globs)
    statuses = {k: v for k, v in every.items() if v != "not checked"}  # all of them after a full run
    statuses = recheck_suspicious(statuses)
    equivalent = in_scope(equivalent_mutants(), globs)
    value, survivors, _ = score(statuses, equivalent)
    stale = sorted(set(equivalent) - set(every))
    by_status: dict[str, int] = {}
    for v in statuses.values():
        by_status[v] = by_status.get(v, 0) + 1
    print(f"checked: {len(statuses)}  " + "  ".join(f"{k}: {n}" for k, n in sorted(by_status.items())))
    print(f"equivalent (docs/correction.md): {len(equivalent)}")
    for name in stale:
        print(f"listed as equivalent but not a mutant of this code (renumbered?): {name}")
    for name in survivors:
        print(f"survived: {name} ({statuses[name]}); `mutmut show {name}` shows it")
    write_report(mutmut, survivors, statuses, value, report)
    print(f"survivors and their changes, by function: {report}")
    print(f"mutation score: {value:.4f}")
    return 0 if value >= GOAL else 1


if __name__ == "__main__":
    raise SystemExit(main())
