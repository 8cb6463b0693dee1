"""The end of ``make agent-demo``: the reward and tool-call figures of a run, from its metrics.jsonl.

    python -m megatron_acrl.rollout.agent.report runs/agent-demo [--window 3]

Prints ``name: value`` lines: the sampled task reward (exact: 1 when the final answer is the sum)
over the first and the last ``--window`` RL steps and its rise, the tool-call rate (calls per
trajectory) and the fraction of trajectories that ended with an answer, first and last; then, when
the run evaluated (``training.eval_interval``), the held-out greedy reward and tool-call rate of its
first eval (step 0: the warm start) and its last, and the rise. Pure Python (reads JSON lines).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def load_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every metric record of a run, in log order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run_dir must be a finished run's directory")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_steps(run_dir: str | Path) -> list[dict[str, Any]]:
    """The RL steps' metric records (those with ``reward/mean``), in step order."""
    return [r for r in load_rows(run_dir) if "reward/mean" in r]


def eval_report(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The held-out greedy evaluation's figures at its first and last eval ({} with fewer than two):
    the reward (``eval/accuracy``), its rise, and the tool-call rate."""
    evals = [r for r in rows if "eval/accuracy" in r]
    if len(evals) < 2:
        return {}
    first, last = evals[0], evals[-1]
    out = {
        "eval step first": float(first["step"]),
        "eval step last": float(last["step"]),
        "held-out greedy tool-call rate first": float(first.get("eval/tool_call_rate", float("nan"))),
        "held-out greedy tool-call rate last": float(last.get("eval/tool_call_rate", float("nan"))),
        "held-out greedy reward first": float(first["eval/accuracy"]),
        "held-out greedy reward last": float(last["eval/accuracy"]),
    }
    out["held-out greedy reward rise"] = (
        out["held-out greedy reward last"] - out["held-out greedy reward first"]
    )
    return out


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    vals = [float(r[key]) for r in rows if key in r]
    return sum(vals) / len(vals) if vals else float("nan")


def _rate(rows: list[dict[str, Any]], key: str) -> float:
    """``key`` (a count per batch) per trajectory."""
    n = sum(float(r.get("rollout/num_sequences", 0)) for r in rows)
    return sum(float(r.get(key, 0)) for r in rows) / n if n else float("nan")


def report(steps: list[dict[str, Any]], window: int) -> dict[str, float]:
    """The demo's figures over the first and last ``window`` steps."""
    if len(steps) < 2 * window:
        raise ValueError(f"{len(steps)} RL steps logged; the report compares the first and last {window}")
    first, last = steps[:window], steps[-window:]
    out = {
        "reward first": _mean(first, "reward/mean"),
        "reward last": _mean(last, "reward/mean"),
        "tool-call rate first": _rate(first, "agent/tool_calls"),
        "tool-call rate last": _rate(last, "agent/tool_calls"),
        "answered frac first": _rate(first, "agent/end_answered"),
        "answered frac last": _rate(last, "agent/end_answered"),
        "turns mean last": _mean(last, "agent/turns_mean"),
    }
    out["reward rise"] = out["reward last"] - out["reward first"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--window", type=int, default=3, help="steps averaged at each end")
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error("--window must be >= 1")
    rows = load_rows(args.run_dir)
    figures = report([r for r in rows if "reward/mean" in r], args.window) | eval_report(rows)
    for name, value in figures.items():
        print(f"{name}: {value:.3f}")


if __name__ == "__main__":
    main()
