"""The mismatch study: grids of arms x seeds through the real loop, then one report with plots.

    python -m megatron_acrl.study configs/study/dense.yaml configs/study/moe_stress.yaml \\
        --out runs/study --report docs/study

A grid file names a base config, overrides common to every run, the seeds, and the arms (each a
list of overrides: BF16 rollout, FP8 with none / tis / seq_mis / icepop / acrl / acrl extensions,
optionally under the stress quantization). Every run is ``python -m megatron_acrl.train`` in its
own process (torchrun when the layout has several ranks), so arms share nothing but the cached
supervised warm-start (one per seed: every arm of a seed starts RL from the same policy) and, with
``shared_server: true`` (the default), one SGLang server per grid (two when some arms emulate an FP8
KV cache, a launch-time setting): each run pushes its own initial
weights before its first rollout, so a server that outlives the previous run serves exactly what a
fresh one would, and the grid saves a server start-up per run.

Run directories are ``<out>/<arm>-s<seed>``; arm names are unique across grids, and a finished run
whose overrides are unchanged is reused (two grids may share their BF16 baseline arm). The report
(``REPORT.md``) has, per grid, the paper's table -- peak and mean-of-last-20% reward per arm, mean
+- std over seeds, collapsed yes/no --, the goal verdict stated with its numbers, and PNG curves of
the per-arm mean over seeds drawn with matplotlib from the runs' ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_acrl.config import Config, ConfigError, load_config
from megatron_acrl.logging import read_jsonl_metrics

COLLAPSE_FRACTION = 0.5
"""An arm-seed has collapsed when its mean reward over the last 20% of steps falls below this fraction
of its own peak (after a 5-step moving average)."""

GRID_KEYS = ("base", "common", "seeds", "arms", "ranks", "title", "notes", "stress", "shared_server")

PANELS = (
    ("reward/mean", "reward (train, sampled)"),
    ("eval/sampled_reward", "eval reward, fixed train prompts (served weights)"),
    ("eval_trainer/sampled_reward", "eval reward, fixed train prompts (trainer's weights)"),
    ("mismatch/k3_kl", "k3 KL(mu || pi_old)"),
    ("mismatch/chi2_token", "chi2 token"),
    ("mismatch/chi2_seq", "chi2 sequence"),
    ("acrl/alpha_mean", "ACRL alpha (mean)"),
    ("acrl/y_over_x", "ACRL Y / X"),
    ("correction/seq_masked_frac", "masked sequence fraction (seq_mis)"),
    ("correction/mask_frac_high", "IcePop masked token fraction (high)"),
    ("correction/mask_frac_low", "IcePop masked token fraction (low)"),
    ("correction/clip_frac_high", "TIS clipped token fraction"),
    ("loss/entropy", "entropy"),
)
"""Report figures: metric key and title; a figure is drawn when any arm logged the key."""


@dataclass(frozen=True)
class Grid:
    """One grid file: a base config, common overrides, seeds and named arms."""

    base: str
    common: tuple[str, ...]
    seeds: tuple[int, ...]
    arms: dict[str, tuple[str, ...]]
    ranks: int = 1
    name: str = "grid"
    """File stem; prefixes the grid's figures."""
    title: str = ""
    notes: str = ""
    """Free text for the report (what the setting is)."""
    stress: bool = False
    """A stress setting: the verdict also compares ACRL with TIS and MIS."""
    shared_server: bool = True
    """One SGLang server for the whole grid (see module doc)."""
    configs: dict[str, Config] = field(default_factory=dict, compare=False, repr=False)
    """Each arm's validated config (seed aside)."""


def load_grid(path: str | Path) -> Grid:
    """Read and validate a grid file: every arm's config must load before anything runs."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    unknown = set(data) - set(GRID_KEYS)
    if unknown:
        raise ConfigError([(f"{path}", f"unknown grid keys {sorted(unknown)}; use {', '.join(GRID_KEYS)}")])
    if not data.get("arms"):
        raise ConfigError([(f"{path}", "a grid needs arms: {name: [overrides...]}")])
    if "base" not in data:
        raise ConfigError([(f"{path}", "a grid needs base: configs/<file>.yaml")])
    seeds = tuple(int(s) for s in data.get("seeds", [1]))
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError([(f"{path}.seeds", f"need distinct seeds, got {list(seeds)}")])
    configs: dict[str, Config] = {}
    arms = {str(k): tuple(str(o) for o in (v or [])) for k, v in data["arms"].items()}
    for arm, overrides in arms.items():
        try:
            configs[arm] = load_config(str(data["base"]), [*data.get("common", []), *overrides])
        except ConfigError as err:
            raise ConfigError(
                [(f"arms.{arm}.{p}" if p else f"arms.{arm}", m) for p, m in err.errors]
            ) from None
    return Grid(
        base=str(data["base"]),
        common=tuple(str(o) for o in data.get("common", [])),
        seeds=seeds,
        arms=arms,
        ranks=int(data.get("ranks", 1)),
        name=Path(path).stem,
        title=str(data.get("title", Path(path).stem)),
        notes=str(data.get("notes", "")).strip(),
        stress=bool(data.get("stress", False)),
        shared_server=bool(data.get("shared_server", True)),
        configs=configs,
    )


# -- running -------------------------------------------------------------------------------------


def server_model_dir(grid: Grid) -> str:
    """The directory the grid's shared server loads: any checkpoint of the architecture will do,
    since every run overwrites all weights before its first rollout."""
    cfg = next(iter(grid.configs.values()))
    if cfg.model.hf_path:
        return cfg.model.hf_path
    from megatron_acrl.tiny_model import build_checkpoint

    return str(build_checkpoint(cfg.model, seed=grid.seeds[0]))


def server_key(cfg: Config) -> str:
    """What a shared server must be launched with for this run: its KV-cache dtype (the FP8 KV
    emulation is a launch-time patch); everything else a run needs arrives with its weights."""
    return cfg.rollout.kv_cache_dtype


@contextlib.contextmanager
def shared_servers(grid: Grid, log_dir: Path) -> Iterator[dict[str, str]]:
    """SGLang CPU servers for the grid, one per distinct :func:`server_key` of its arms (a BF16-KV
    baseline and FP8-KV arms need two); empty when the grid starts a server per run. The servers
    sleep while idle, so a grid's idle second server costs no CPU."""
    cfg = next(iter(grid.configs.values()))
    if not grid.shared_server or cfg.rollout.server_urls or cfg.rollout.backend != "sglang":
        yield {}
        return
    from megatron_acrl.rollout_servers import resolve_device
    from sglang_bridge.server import ServerSpec, SGLangServer

    model_dir = server_model_dir(grid)
    device = resolve_device(cfg)
    if device == "cuda" and any(c.rollout.quantization != "none" for c in grid.configs.values()):
        # A real-FP8 server is started with --quantization fp8 and cannot also serve the BF16 arm.
        yield {}
        return
    keys = sorted({server_key(c) for c in grid.configs.values()})
    with contextlib.ExitStack() as stack:
        urls = {}
        for key in keys:
            spec = ServerSpec(
                model_path=model_dir,
                device=device,  # type: ignore[arg-type]
                random_seed=grid.seeds[0],
                kv_cache_dtype=key,  # type: ignore[arg-type]
                # One intra-op thread, like the runs' trainers: grids run concurrently (--jobs), and
                # OpenMP threads spin-waiting on an oversubscribed 2-core machine made steps 10-20x
                # slower with three 2-thread servers. A tiny model gains little from a second thread.
                extra_env=(("OMP_NUM_THREADS", "1"),),
            )
            suffix = "" if key == "auto" else f"_kv_{key}"
            server = SGLangServer(
                spec,
                log_dir / f"sglang_{grid.name}{suffix}.log",
                startup_timeout_s=cfg.rollout.startup_timeout_s,
            )
            stack.callback(server.stop)
            server.start()
            urls[key] = server.url
        yield urls


def run_arm(grid: Grid, arm: str, seed: int, out: Path, server_url: str | None = None) -> Path:
    """One training run; returns its run directory (reused when it finished with the same overrides)."""
    run_dir = out / f"{arm}-s{seed}"
    done = run_dir / "done"
    overrides = [*grid.common, *grid.arms[arm], f"training.seed={seed}", "training.checkpoint_dir=null"]
    key = {"base": grid.base, "overrides": overrides}
    if done.exists():
        try:
            if {k: v for k, v in json.loads(done.read_text()).items() if k in key} == key:
                return run_dir
        except ValueError:
            pass  # an old marker: rerun
    cmd_overrides = [*overrides]
    if server_url:
        cmd_overrides.append(f'rollout.server_urls=["{server_url}"]')
    if grid.ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launcher.append(f"--nproc-per-node={grid.ranks}")
    else:
        launcher = [sys.executable]
    cmd = [*launcher, "-m", "megatron_acrl.train", "--config", grid.base, "--run-dir", str(run_dir)]
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    if run_dir.exists():  # a stale or changed run: start clean so metrics.jsonl is this run's alone
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    t0 = time.monotonic()
    with open(run_dir / "train.log", "w") as log:
        rc = subprocess.run([*cmd, *cmd_overrides], stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise RuntimeError(f"study run {arm} seed {seed} failed (rc={rc}); see {run_dir / 'train.log'}")
    done.write_text(json.dumps({**key, "wall_s": time.monotonic() - t0}) + "\n")
    return run_dir


def run_grid(grid: Grid, out: Path) -> float:
    """Every arm x seed of ``grid`` (seed-major, so a partial grid already has whole seeds);
    returns the wall seconds spent. A failed run gets one retry on a fresh server."""
    t0 = time.monotonic()
    todo = [(arm, seed) for seed in grid.seeds for arm in grid.arms]
    out.mkdir(parents=True, exist_ok=True)
    retried: set[tuple[str, int]] = set()
    while todo:
        with shared_servers(grid, out) as urls:
            while todo:
                arm, seed = todo[0]
                t1 = time.monotonic()
                print(f"study[{grid.name}]: {arm} seed {seed}", flush=True)
                try:
                    run_arm(grid, arm, seed, out, urls.get(server_key(grid.configs[arm])))
                except RuntimeError as err:
                    if (arm, seed) in retried:
                        raise
                    print(f"study[{grid.name}]: {err}; retrying on a fresh server", flush=True)
                    retried.add((arm, seed))
                    break  # leave the with-block: the server is restarted, the run retried
                todo.pop(0)
                print(
                    f"study[{grid.name}]: {arm} seed {seed} done in {time.monotonic() - t1:.0f}s", flush=True
                )
    return time.monotonic() - t0


def grid_groups(grids: Sequence[Grid]) -> list[list[Grid]]:
    """Grids that share an arm name (the shared BF16 baseline run) must run one after the other:
    connected components of the shares-an-arm relation, in file order."""
    groups: list[list[Grid]] = []
    for g in grids:
        joined = [grp for grp in groups if any(set(g.arms) & set(h.arms) for h in grp)]
        merged = [h for grp in joined for h in grp] + [g]
        groups = [grp for grp in groups if grp not in joined] + [merged]
    return groups


def run_grids(grids: Sequence[Grid], out: Path, jobs: int = 1) -> None:
    """Run every grid; with ``jobs > 1`` independent groups of grids run concurrently (each run is a
    subprocess, so threads only wait). On a small CPU two jobs overlap one run's rollout server with
    another's trainer."""
    from concurrent.futures import ThreadPoolExecutor

    def work(group: list[Grid]) -> None:
        for g in group:
            spent = run_grid(g, out)
            print(f"study[{g.name}]: grid finished in {spent / 60:.1f} min", flush=True)

    groups = grid_groups(grids)
    if jobs <= 1 or len(groups) == 1:
        for grp in groups:
            work(grp)
        return
    # Heavy imports (transformers' lazy modules deadlocked when first imported from several threads
    # at once) and the servers' checkpoints happen here, in the main thread, before the workers.
    import megatron_acrl.rollout_servers  # noqa: F401
    import sglang_bridge.server  # noqa: F401

    for g in grids:
        if g.shared_server:
            server_model_dir(g)
    # Largest groups first, each worker taking the next group when free.
    groups.sort(key=lambda grp: -sum(len(g.arms) * len(g.seeds) for g in grp))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for f in [pool.submit(work, grp) for grp in groups]:
            f.result()


# -- summaries -----------------------------------------------------------------------------------


def _smooth(xs: list[float], k: int = 5) -> list[float]:
    return [statistics.mean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def summarize(rows: list[dict], key: str = "reward/mean") -> dict[str, float]:
    """Peak (raw and of the 5-step moving average), mean of the last 20% of steps, collapsed or not."""
    ys = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
    if not ys:
        return {"peak": math.nan, "peak_smooth": math.nan, "last20": math.nan, "collapsed": 0.0}
    tail = ys[-max(1, len(ys) // 5) :]
    peak = max(_smooth(ys))
    last = statistics.mean(tail)
    return {
        "peak": max(ys),
        "peak_smooth": peak,
        "last20": last,
        "collapsed": float(peak > 0 and last < COLLAPSE_FRACTION * peak),
    }


def _mean_rows(runs: list[list[dict]]) -> list[dict]:
    """Per-step mean and std over seeds of every numeric key (steps all seeds reached)."""
    steps = min(len(r) for r in runs)
    out = []
    for i in range(steps):
        keys = set.intersection(*(set(r[i]) for r in runs))
        row: dict = {"step": runs[0][i]["step"]}
        for k in keys:
            vals = [r[i][k] for r in runs]
            if all(isinstance(v, int | float) and math.isfinite(float(v)) for v in vals):
                row[k] = statistics.mean(float(v) for v in vals)
                row[k + ":std"] = statistics.stdev(float(v) for v in vals) if len(vals) > 1 else 0.0
        out.append(row)
    return out


def _ms(xs: Sequence[float]) -> tuple[float, float]:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _fmt(xs: Sequence[float], digits: int = 3) -> str:
    m, s = _ms(xs)
    if math.isnan(m):
        return "-"
    if len(xs) == 1:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} +- {s:.{digits}f}"


def _fmt_sci(xs: Sequence[float]) -> str:
    m, s = _ms(xs)
    return "-" if math.isnan(m) else f"{m:.2e} +- {s:.1e}"


@dataclass
class ArmResult:
    """One arm's per-seed summaries."""

    arm: str
    method: str
    quantization: str
    peak: list[float]
    last20: list[float]
    collapsed: list[bool]
    eval_acc: list[float]
    k3: list[float]
    rows: list[list[dict]]
    first: list[float] = field(default_factory=list)
    """Sampled reward of the first RL step: every arm of a grid starts from the same weights there, so
    its gap to the BF16 arm is what FP8 sampling alone costs, before any training."""
    served_eval: list[float] = field(default_factory=list)
    """Final ``eval/sampled_reward``: fixed training prompts, sampled from the served (rollout) weights."""
    trainer_eval: list[float] = field(default_factory=list)
    """Final ``eval_trainer/sampled_reward``: the same prompts sampled from the trainer's unquantized
    weights, i.e. what training learned, without what FP8 sampling loses."""
    seeds: list[int] = field(default_factory=list)
    """The finished seeds, in the order of the lists above."""

    @property
    def last20_ms(self) -> tuple[float, float]:
        return _ms(self.last20)


def collect(grid: Grid, out: Path) -> list[ArmResult]:
    """Summaries of every arm of a finished grid."""
    results = []
    for arm, cfg in grid.configs.items():
        # Only finished runs count (a grid cut short reports the seeds it has; the table says how many).
        seeds = [s for s in grid.seeds if (out / f"{arm}-s{s}" / "done").exists()]
        runs = [read_jsonl_metrics(out / f"{arm}-s{s}" / "metrics.jsonl") for s in seeds]
        if not runs:
            continue
        sums = [summarize(r) for r in runs]
        results.append(
            ArmResult(
                arm=arm,
                method=cfg.correction.method,
                quantization=cfg.rollout.quantization,
                peak=[s["peak_smooth"] for s in sums],
                last20=[s["last20"] for s in sums],
                collapsed=[bool(s["collapsed"]) for s in sums],
                eval_acc=[_final(r, "eval/accuracy") for r in runs],
                k3=[summarize(r, "mismatch/k3_kl")["last20"] for r in runs],
                first=[float(r[0].get("reward/mean", math.nan)) for r in runs],
                served_eval=[_final(r, "eval/sampled_reward") for r in runs],
                trainer_eval=[_final(r, "eval_trainer/sampled_reward") for r in runs],
                rows=runs,
                seeds=seeds,
            )
        )
    return results


def _final(rows: list[dict], key: str) -> float:
    """The last logged value of ``key`` in a run (nan if it never was)."""
    return next((float(x[key]) for x in reversed(rows) if isinstance(x.get(key), int | float)), math.nan)


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145)
"""Student's t 97.5% quantiles for 1..14 degrees of freedom (a two-sided 95% interval)."""


def paired_ci(diffs: Sequence[float]) -> tuple[float, float] | None:
    """95% confidence interval of the mean of paired differences (Student's t; normal quantile past
    14 degrees of freedom, which the t table would change by < 0.1 of the half-width); None for
    fewer than 2 pairs."""
    n = len(diffs)
    if n < 2:
        return None
    q = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    m, half = statistics.mean(diffs), q * statistics.stdev(diffs) / math.sqrt(n)
    return m - half, m + half


def _cmp(a: ArmResult, b: ArmResult, strict: bool, metric: str = "last20") -> str:
    """``a`` vs ``b`` on ``metric`` (an ArmResult list: mean-of-last-20% reward by default) over the
    seeds both finished (paired by seed), with the numbers, the 95% CI of the paired difference and
    the per-seed wins; fewer than 3 common seeds is said to be no result over seeds."""
    va, vb = getattr(a, metric), getattr(b, metric)
    sa_, sb_ = a.seeds or list(range(len(va))), b.seeds or list(range(len(vb)))
    common = [
        s for s in sa_ if s in sb_ and math.isfinite(va[sa_.index(s)]) and math.isfinite(vb[sb_.index(s)])
    ]
    xa = [va[sa_.index(s)] for s in common]
    xb = [vb[sb_.index(s)] for s in common]
    if not common:
        return f"`{a.arm}` vs `{b.arm}`: **no common finished seed**, no comparison"
    (ma, sa), (mb, sb) = _ms(xa), _ms(xb)
    ok = ma > mb if strict else ma >= mb
    wins = sum(x > y if strict else x >= y for x, y in zip(xa, xb, strict=True))
    sign = ">" if strict else ">="
    few = "" if len(common) >= 3 else f"; only {len(common)} common seed(s): not a result over seeds"
    ci = paired_ci([x - y for x, y in zip(xa, xb, strict=True)])
    ci_txt = f", 95% CI {ci[0]:+.3f} to {ci[1]:+.3f}" if ci else ""
    return (
        f"`{a.arm}` {ma:.3f} +- {sa:.3f} vs `{b.arm}` {mb:.3f} +- {sb:.3f}: "
        f"**{'yes' if ok else 'no'}** (difference {ma - mb:+.3f}{ci_txt}; {sign} on {wins}/{len(common)} "
        f"seeds, paired by seed{few})"
    )


def verdict(grid: Grid, results: list[ArmResult], metric: str = "last20") -> list[str]:
    """The goal, stated per grid: ACRL >= BF16 rollout; in a stress grid also ACRL > TIS and > MIS
    (on mean-of-last-20% reward, or on another ArmResult list ``metric``)."""
    base = [r for r in results if r.quantization == "none"]
    acrl = [r for r in results if r.method == "acrl" and r.quantization != "none"]
    lines = []
    if not base or not acrl:
        return ["(no BF16-rollout baseline or no ACRL arm in this grid: no verdict)"]
    if not any(math.isfinite(x) for r in results for x in getattr(r, metric)):
        return [f"(no arm logged {metric}: no verdict)"]
    for a in acrl:
        lines.append(f"- ACRL >= BF16 rollout: {_cmp(a, base[0], False, metric)}")
        if grid.stress:
            for method, label in (("tis", "TIS"), ("seq_mis", "MIS")):
                for other in (r for r in results if r.method == method):
                    lines.append(f"- ACRL > {label}: {_cmp(a, other, True, metric)}")
    none = [r for r in results if r.method == "none" and r.quantization != "none"]
    for n in none:
        collapsed = (
            f"; collapsed in {sum(n.collapsed)}/{len(n.collapsed)} seeds" if metric == "last20" else ""
        )
        lines.append(
            f"- Uncorrected FP8 >= BF16 rollout (i.e. no degradation): "
            f"{_cmp(n, base[0], False, metric)}{collapsed}."
        )
    return lines


# -- report --------------------------------------------------------------------------------------


def plot_grid(grid: Grid, results: list[ArmResult], report_dir: Path) -> list[Path]:
    """One PNG per panel: the per-arm mean over seeds (5-step moving average; eval metrics, logged
    every few steps, unsmoothed with markers), +- one std band on the training reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    means = {r.arm: _mean_rows(r.rows) for r in results}
    for key, title in PANELS:
        if not any(key in row for rows in means.values() for row in rows):
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for arm, rows in means.items():
            pts = [(int(r["step"]), r[key], r.get(key + ":std", 0.0)) for r in rows if key in r]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            sparse = len(pts) < len(rows) // 2  # logged every few steps (evals): drawn as is, with markers
            ys = [p[1] for p in pts] if sparse else _smooth([p[1] for p in pts])
            sd = [p[2] for p in pts] if sparse else _smooth([p[2] for p in pts])
            (line,) = ax.plot(xs, ys, label=arm, lw=1.4, marker="o" if sparse else None, ms=3)
            if key.endswith("reward/mean"):  # the band only where it is read: the training reward
                lo = [y - s for y, s in zip(ys, sd, strict=True)]
                hi = [y + s for y, s in zip(ys, sd, strict=True)]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.08)
        if key.startswith(("mismatch/k3", "mismatch/chi2")):
            ax.set_yscale("symlog", linthresh=1e-5)
        ax.set_title(f"{grid.name}: {title}", fontsize=9)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = report_dir / f"{grid.name}_{key.replace('/', '_')}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def _steps(results: list[ArmResult]) -> int:
    return max(len(r) for a in results for r in a.rows) if results else 0


def write_report(
    grids: Sequence[Grid], out: Path, report_dir: Path, wall_s: float | None = None, note: str = ""
) -> Path:
    """REPORT.md and PNGs in ``report_dir`` from the finished runs under ``out``."""
    report_dir.mkdir(parents=True, exist_ok=True)
    run_walls, starts, ends = [], [], []
    for g in grids:
        for arm in g.arms:
            for s in g.seeds:
                done = out / f"{arm}-s{s}" / "done"
                with contextlib.suppress(OSError, ValueError, KeyError):
                    w = float(json.loads(done.read_text())["wall_s"])
                    run_walls.append(w)
                    ends.append(done.stat().st_mtime)
                    starts.append(ends[-1] - w)
    lines = [
        "# Mismatch study report",
        "",
        "Generated by `python -m megatron_acrl.study "
        + " ".join(f"configs/study/{g.name}.yaml" for g in grids)
        + "` from the runs' `metrics.jsonl` (nothing here is edited by hand). Every run is the real loop: "
        "Megatron-Core trainer (CPU, gloo), SGLang CPU rollout server, the weight-sync bridge. FP8 on a "
        "CPU server is *fake-quant*: the trainer quantizes -> dequantizes and sends bf16 weights, so the "
        "rollout sees FP8 weight rounding, not FP8 activations"
        + (
            "; arms with `rollout.kv_cache_dtype=fp8_e4m3` also round every cached K and V through e4m3 "
            "(SGLang's FP8 KV cache, emulated in the bf16 cache on CPU)."
            if any(c.rollout.kv_cache_dtype != "auto" for g in grids for c in g.configs.values())
            else " or KV cache."
        ),
        "",
    ]
    if note:
        lines += [f"**How this report was run.** {note}", ""]
    wall_file = out / "study_wall.json"
    if wall_s is None and wall_file.exists():  # --report-only: the wall time of the run that made them
        with contextlib.suppress(OSError, ValueError, KeyError):
            wall_s = float(json.loads(wall_file.read_text())["wall_s"])
    if wall_s is not None:
        lines.append(f"Wall time of the grid invocation: {wall_s / 60:.1f} min.")
    if starts:  # holds also when several invocations (--seeds) shared --out concurrently
        lines.append(
            f"First run start to last run end: {(max(ends) - min(starts)) / 60:.1f} min (server start-up "
            "before the first run not included)."
        )
    if run_walls:
        lines.append(
            f"Sum of the {len(run_walls)} runs' own wall times: {sum(run_walls) / 60:.1f} min "
            f"(median {statistics.median(run_walls):.0f} s per run)."
        )
    lines += [
        "",
        "Columns: reward is the sampled training reward (fraction of correct completions in the step's "
        "rollout batch, temperature 1). *peak* is the maximum of its 5-step moving average; *last 20%* the "
        "mean over the last 20% of steps; both mean +- std over seeds. *step 1* is the first step's "
        "sampled reward: every arm starts from the same warm-start weights, so its gap to the BF16 arm is "
        "what FP8 sampling alone costs before any training. *greedy acc* is the final greedy "
        "accuracy on the held-out split. *eval: served / trainer* is the sampled reward at the final eval "
        "on a fixed set of training prompts (`training.eval_samples` samples each, temperature 1), "
        "sampled from the served rollout weights and from the trainer's own unquantized weights "
        "(`training.eval_trainer_weights`: pushed to the same server for the eval, then the rollout copy "
        "is pushed back; the server's KV-cache dtype still applies): the second separates what training "
        "learned from what FP8 sampling loses. "
        f"*collapsed*: last-20% mean below {COLLAPSE_FRACTION:.0%} of the "
        "run's smoothed peak (runs collapsed / seeds).",
        "",
    ]
    collected = {g.name: collect(g, out) for g in grids}
    lines += [
        "## Goal verdict at a glance",
        "",
        "Each line: the two arms' means +- std over seeds, the verdict on the means, the mean paired "
        "difference with its 95% confidence interval (Student's t over the seeds both arms finished) "
        "and the seeds on which the comparison holds. An interval that contains 0 means these seeds "
        "do not tell the two arms apart.",
        "",
    ]
    for g in grids:
        lines += [f"*{g.title}* (`{g.name}`):", ""]
        lines += verdict(g, collected[g.name])
        lines.append("")
    if any(math.isfinite(x) for res in collected.values() for r in res for x in r.trainer_eval):
        lines += [
            "## The same comparisons on the trainer's own weights (supplementary, not the goal's metric)",
            "",
            "Final-eval sampled reward of each arm's trained policy sampled with its unquantized weights "
            "(*eval: trainer* above; BF16 arms: the served weights are the trainer's). This asks whether "
            "a correction let training learn as well as with BF16 rollouts, apart from the FP8 sampler's "
            "own loss. One eval per run (not a mean over steps), so noisier than the goal's metric.",
            "",
        ]
        for g in grids:
            lines += [f"*{g.title}* (`{g.name}`):", ""]
            lines += verdict(g, collected[g.name], "trainer_eval")
            lines.append("")
    for g in grids:
        results = collected[g.name]
        cfg = next(iter(g.configs.values()))
        m = cfg.model
        moe = f", {m.num_experts} experts top-{m.moe_router_topk}" if m.is_moe else ""
        lines += [f"## {g.title}", ""]
        if g.notes:
            lines += [g.notes, ""]
        lines += [
            f"Grid `configs/study/{g.name}.yaml`: base `{g.base}`, seeds {list(g.seeds)}, "
            f"{_steps(results)} RL steps, model `{m.family}` ({m.num_layers} layers, hidden "
            f"{m.hidden_size}{moe}"
            + f"), {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.n_samples_per_prompt} samples per "
            f"step, {cfg.algorithm.name} ({cfg.algorithm.ppo_epochs} epoch(s) x "
            f"{cfg.algorithm.num_minibatches} minibatch(es)), lr {cfg.training.lr:g}, task "
            f"{cfg.task.name} ({cfg.task.num_digits} digit(s)).",
            "",
            f"Common overrides: `{' '.join(g.common) or '-'}`",
            "",
            "| arm | overrides | seeds | reward, step 1 | peak reward | reward, last 20% | greedy acc "
            "| eval: served | eval: trainer | k3 KL, last 20% | collapsed |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            n = sum(r.collapsed)
            ov = " ".join(g.arms[r.arm]) or "-"
            lines.append(
                f"| {r.arm} | `{ov}` | {len(r.last20)} | {_fmt(r.first)} | {_fmt(r.peak)} | "
                f"{_fmt(r.last20)} | {_fmt(r.eval_acc, 2)} | {_fmt(r.served_eval)} | "
                f"{_fmt(r.trainer_eval)} | {_fmt_sci(r.k3)} | {'yes' if n else 'no'} "
                f"({n}/{len(r.collapsed)}) |"
            )
        lines += ["", "**Goal verdict** (mean-of-last-20% reward, mean +- std over seeds):", ""]
        lines += verdict(g, results)
        lines += ["", "Curves: per-arm mean over seeds, 5-step moving average (reward: +- 1 std band).", ""]
        lines += [f"![{f.stem}]({f.name})" for f in plot_grid(g, results, report_dir)]
        lines.append("")
    path = report_dir / "REPORT.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_acrl.study", description=__doc__.split("\n")[0])
    ap.add_argument("grids", nargs="+", help="grid YAML files in configs/study/ (run in turn)")
    ap.add_argument("--out", default="runs/study", help="where the runs go (finished runs are reused)")
    ap.add_argument("--report", default="docs/study", help="where REPORT.md and the plots go")
    ap.add_argument("--report-only", action="store_true", help="write the report from finished runs")
    ap.add_argument("--note", default="", help="a paragraph for the top of the report (how it was run)")
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="run only these of the grids' seeds (several invocations can share --out; the report "
        "covers every finished seed of the grid files)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="grids run concurrently, each with its own server (grids sharing an arm stay together)",
    )
    args = ap.parse_args(argv)
    try:
        grids = [load_grid(p) for p in args.grids]
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    names = [a for g in grids for a in g.arms]
    clash = {a for a in names if names.count(a) > 1}
    for a in clash:  # a shared arm (e.g. the BF16 baseline) must be the same run in every grid
        specs = {(g.base, g.common, g.arms[a]) for g in grids if a in g.arms}
        if len(specs) > 1:
            print(f"arm {a!r} appears in several grids with different settings; rename one", file=sys.stderr)
            return 2
    out = Path(args.out)
    t0 = time.monotonic()
    if not args.report_only:
        todo = grids
        if args.seeds:
            todo = [dataclasses.replace(g, seeds=tuple(x for x in g.seeds if x in args.seeds)) for g in grids]
        run_grids([g for g in todo if g.seeds], out, args.jobs)
    wall = time.monotonic() - t0
    if not args.report_only:
        (out / "study_wall.json").write_text(
            json.dumps({"wall_s": wall, "grids": [g.name for g in grids], "jobs": args.jobs}) + "\n"
        )
    report = write_report(grids, out, Path(args.report), None if args.report_only else wall, note=args.note)
    print(f"study report: {report}")
    print(f"study: total wall time {wall / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
