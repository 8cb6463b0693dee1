"""LoRA vs full-parameter RL on the demo's task, side by side (issue #35, the learning goal).

    python benchmarks/lora_learning.py [--reps 2] [--ranks 16] [--lora-lr 5e-3] [--steps 40]
                                       [--only full:1] [--out runs/lora-learning] [--smoke]

Runs the real driver (``launch.torchrun``, 2 Megatron ranks, a real SGLang CPU server: ``make
demo``'s command) on ``configs/demo.yaml``, once full-parameter (the config as shipped, lr 1e-3)
and once per ``--ranks`` entry with ``model.lora={rank: r, alpha: 32, sync: adapter}`` at
``--lora-lr`` (LoRA wants a larger lr than full training: the adapters start at zero and the
alpha / r scale is fixed), ``--reps`` times each, interleaved (full, r16, ..., full, r16, ...):
same config, same seed, same warm start (the supervised warm start is cached and shared by both
arms: ``model.lora`` adapts the RL policy, not the base), so every run starts from the same exact
J at step 0. Checkpoints and W&B are off (they measure nothing here).

The figure is the exact expected reward J (``eval/exact_j``: mean over all 100 prompts of
P(answer + EOS | prompt), teacher-forced on the trainer's weights; no sampling noise in the
metric itself) at the last step minus step 0. Its run-to-run spread is large all the same (the
sampled rollouts differ: the demo's J at step 40 has ranged 0.36-0.61), so each arm's gain is the
mean over its runs, every run printed.

A finished run (its ``metrics.jsonl`` reaching ``--steps``) is reused, so the runs can be made one
at a time (``--only ARM:REP``, e.g. ``--only r16:2``) and reported together by a last call without
``--only`` (``--report-only``: no run, the finished ones of the plan). Prints, last: ``exact J gain
(full): X``, ``exact J gain (lora rR): Y`` per rank and ``lora J gain gap: Z`` (full minus the
first rank's gain; goal <= 0.05) -- the goal figure last.
``--smoke``: 2 steps, one rep, a short warm start: checks the benchmark, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the package is the repository's

from megatron_acrl.logging import read_jsonl_metrics  # noqa: E402

CONFIG = ROOT / "configs" / "demo.yaml"
COMMON = ["logging.wandb_mode=disabled", "training.checkpoint_dir=null", "training.save_interval=0"]
LORA_ALPHA = 32.0
"""alpha of every rank (the config's default): the adapter's scale alpha / r then falls with r as its
update's size grows with r, so one lr serves every rank (with alpha = 2r, rank 64 at the lr that
suits rank 16 collapsed the policy: J 0.34 -> 0.006 in 40 steps)."""
SMOKE = ["training.sft_steps=10", "rollout.prompts_per_step=8", "training.micro_batch_size=16"]


def arm_overrides(arm: str, lora_lr: float) -> list[str]:
    """The dotted overrides of one arm: ``full`` (the demo as shipped) or ``r<rank>`` (LoRA)."""
    if arm == "full":
        return []
    rank = int(arm[1:])
    return [
        f"model.lora={{rank: {rank}, alpha: {LORA_ALPHA}, sync: adapter}}",
        f"training.lr={lora_lr}",
        f"training.min_lr={lora_lr}",
    ]


def finished(run_dir: Path, steps: int) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and any(r.get("step") == steps for r in read_jsonl_metrics(path))


def run_one(run_dir: Path, overrides: list[str]) -> float:
    """One driver run into ``run_dir`` (replaced); returns its wall seconds."""
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cmd = [
        sys.executable,
        "-m",
        "launch.torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "megatron_acrl.train",
        "--config",
        str(CONFIG),
        "--run-dir",
        str(run_dir),
        *overrides,
    ]
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    log = run_dir.parent / f"{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if res.returncode != 0:
        tail = log.read_text()[-4000:]
        raise SystemExit(f"run {run_dir.name} failed (rc={res.returncode}; log {log}):\n{tail}")
    return time.perf_counter() - t0


def exact_j(run_dir: Path, steps: int) -> dict[str, float]:
    """``eval/exact_j`` (trainer) and ``eval/exact_j_served`` at step 0 and at ``steps``."""
    rows = {r["step"]: r for r in read_jsonl_metrics(run_dir / "metrics.jsonl") if "eval/exact_j" in r}
    if 0 not in rows or steps not in rows:
        raise SystemExit(f"{run_dir}: no exact J at step 0 and {steps} (training.exact_eval_interval)")
    first, last = rows[0], rows[steps]
    return {
        "j0": first["eval/exact_j"],
        "j": last["eval/exact_j"],
        "gain": last["eval/exact_j"] - first["eval/exact_j"],
        "served_gain": last["eval/exact_j_served"] - first["eval/exact_j_served"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=2, help="runs per arm")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16], help="LoRA ranks (one arm each)")
    ap.add_argument("--lora-lr", type=float, default=5e-3, help="training.lr (constant) of the LoRA arms")
    ap.add_argument("--steps", type=int, default=40, help="RL steps (training.num_steps)")
    ap.add_argument(
        "--only", default=None, metavar="ARM:REP", help="make this one run (full:1, r16:2), no report"
    )
    ap.add_argument(
        "--report-only", action="store_true", help="make no run: report the finished runs of the plan"
    )
    ap.add_argument("--out", default=str(ROOT / "runs" / "lora-learning"), help="where the runs go")
    ap.add_argument("--smoke", action="store_true", help="2 steps, one rep: checks the benchmark only")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.reps = 2, 1
    if args.reps < 1 or args.steps < 1 or any(r < 1 for r in args.ranks):
        ap.error("--reps, --steps and every --ranks entry must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    arms = ["full", *(f"r{r}" for r in args.ranks)]
    # the exact metric at step 0 and at the last step (every 10 steps as the demo, when they divide)
    interval = 10 if args.steps % 10 == 0 else args.steps
    base = [f"training.num_steps={args.steps}", f"training.exact_eval_interval={interval}", *COMMON]
    base += SMOKE if args.smoke else []
    # LoRA runs get their lr in their directory name: a pilot at another lr is another run
    name = {a: a if a == "full" else f"{a}-lr{args.lora_lr:g}" for a in arms}
    plan = [(a, k) for k in range(1, args.reps + 1) for a in arms]
    if args.only:
        arm, _, rep = args.only.partition(":")
        if arm not in arms or not rep.isdigit():
            raise SystemExit(f"--only {args.only!r}: expected ARM:REP with ARM one of {arms}")
        plan = [(arm, int(rep))]
    if args.report_only:
        plan = [(a, k) for a, k in plan if finished(out / f"{name[a]}-{k}", args.steps)]
        if {a for a, _ in plan} != set(arms):
            raise SystemExit(f"--report-only: not every arm of {arms} has a finished run in {out}")
    for arm, k in plan:
        run_dir = out / f"{name[arm]}-{k}"
        if finished(run_dir, args.steps):
            continue
        secs = run_one(run_dir, base + arm_overrides(arm, args.lora_lr))
        print(f"ran {run_dir.name}: {secs:.0f} s", flush=True)
    if args.only:
        return 0
    gains: dict[str, list[float]] = {}
    for arm, k in sorted(plan, key=lambda p: arms.index(p[0])):
        j = exact_j(out / f"{name[arm]}-{k}", args.steps)
        gains.setdefault(arm, []).append(j["gain"])
        print(
            f"{name[arm]}-{k}: exact J {j['j0']:.3f} -> {j['j']:.3f} (gain {j['gain']:+.3f}; "
            f"served gain {j['served_gain']:+.3f})"
        )
    mean = {a: statistics.fmean(g) for a, g in gains.items()}
    for a in arms:
        spread = f" (runs: {', '.join(f'{g:+.3f}' for g in gains[a])})" if len(gains[a]) > 1 else ""
        label = "full" if a == "full" else f"lora {a}, lr {args.lora_lr:g}"
        print(f"exact J gain ({label}) mean over {len(gains[a])}{spread}")
    print(f"exact J gain (full): {mean['full']:.4f}")
    for r in args.ranks:
        print(f"exact J gain (lora r{r}): {mean[f'r{r}']:.4f}")
    print(f"lora J gain gap: {mean['full'] - mean[f'r{args.ranks[0]}']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
