"""The end of ``make agent-demo``: the reward and tool-call figures of a run, from its metrics.jsonl.

    python -m megatron_acrl.rollout.agent.report runs/agent-demo [--window 3]

Prints ``name: value`` lines: the sampled task reward (exact: 1 when the final answer is the sum)
over the first and the last ``--window`` RL steps and its rise, the tool-call rate (calls per
trajectory) and the fraction of trajectories that ended with an answer, first and last, and the
run's wall time. Pure Python (reads JSON lines).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def load_steps(run_dir: str | Path) -> list[dict[str, Any]]:
    """The RL steps' metric records (those with ``reward/mean``), in step order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run_dir must be a finished run's directory")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "reward/mean" in r]


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
    for name, value in report(load_steps(args.run_dir), args.window).items():
        print(f"{name}: {value:.3f}")


if __name__ == "__main__":
    main()
