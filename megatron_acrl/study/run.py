"""Running the study: one training run per arm x seed, a grid's shared servers, grids side by side.

Every run is ``python -m megatron_acrl.train`` in its own process (torchrun when the grid has several
ranks) in ``<out>/<arm>-s<seed>``; a run that finished with the same overrides is reused. A grid's
shared SGLang servers (one per KV-cache dtype of its arms) outlive its runs: each run pushes its own
initial weights first. With ``--jobs N`` independent groups of grids run in N threads.

Stopping: the study's entry point passes its :class:`~megatron_acrl.signals.StopSignals`; after a
first SIGTERM / SIGINT no new run starts, and a run that ends while a stop is requested is not
marked finished (it may have been stopped with the study, e.g. by the same Ctrl-C).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_acrl.config import Config
from megatron_acrl.signals import Interrupted, StopSignals
from megatron_acrl.study.grid import Grid, grid_groups


class StudyStopped(Exception):
    """A stop signal reached the study: the runs finished so far are kept, nothing else starts."""


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


SERVER_KEY_ENV = "ACRL_SGLANG_API_KEY"
"""The variable a run on a grid's shared servers finds their key in (``rollout.api_key_env``)."""


@contextlib.contextmanager
def shared_servers(grid: Grid, log_dir: Path, api_key: str) -> Iterator[dict[str, str]]:
    """SGLang CPU servers for the grid, one per distinct :func:`server_key` of its arms (a BF16-KV
    baseline and FP8-KV arms need two); empty when the grid starts a server per run. The servers
    sleep while idle, so a grid's idle second server costs no CPU. They demand ``api_key``, which
    only the grid's runs are given."""
    cfg = next(iter(grid.configs.values()))
    if not grid.shared_server or cfg.rollout.server_urls or cfg.rollout.backend != "sglang":
        yield {}
        return
    from megatron_acrl.server_weights import resolve_device
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
                api_key=api_key,
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


def run_arm(
    grid: Grid,
    arm: str,
    seed: int,
    out: Path,
    server_url: str | None = None,
    stop: StopSignals | None = None,
    server_api_key: str | None = None,
) -> Path:
    """One training run; returns its run directory (reused when it finished with the same overrides).
    Raises :class:`StudyStopped` when ``stop`` was requested while it ran (no ``done`` marker)."""
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
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    if server_url:  # the key travels in the environment, never on the command line
        cmd_overrides += [f'rollout.server_urls=["{server_url}"]', f"rollout.api_key_env={SERVER_KEY_ENV}"]
        env[SERVER_KEY_ENV] = server_api_key or ""
    if grid.ranks > 1:
        launcher = [sys.executable, "-m", "launch.torchrun", "--standalone"]  # stores on loopback
        launcher.append(f"--nproc-per-node={grid.ranks}")
    else:
        launcher = [sys.executable]
    cmd = [*launcher, "-m", "megatron_acrl.train", "--config", grid.base, "--run-dir", str(run_dir)]
    if run_dir.exists():  # a stale or changed run: start clean so metrics.jsonl is this run's alone
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    t0 = time.monotonic()
    with open(run_dir / "train.log", "w") as log:
        rc = subprocess.run([*cmd, *cmd_overrides], stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if stop is not None and stop.requested:
        raise StudyStopped(f"study run {arm} seed {seed} ended under {stop.name} (rc={rc}); not kept")
    if rc != 0:
        raise RuntimeError(f"study run {arm} seed {seed} failed (rc={rc}); see {run_dir / 'train.log'}")
    done.write_text(json.dumps({**key, "wall_s": time.monotonic() - t0}) + "\n")
    return run_dir


def run_grid(grid: Grid, out: Path, stop: StopSignals | None = None) -> float:
    """Every arm x seed of ``grid`` (seed-major, so a partial grid already has whole seeds);
    returns the wall seconds spent. A failed run gets one retry on a fresh server."""
    t0 = time.monotonic()
    todo = [(arm, seed) for seed in grid.seeds for arm in grid.arms]
    out.mkdir(parents=True, exist_ok=True)
    retried: set[tuple[str, int]] = set()
    while todo:
        key = secrets.token_urlsafe(32)  # one per set of shared servers
        with shared_servers(grid, out, key) as urls:
            while todo:
                arm, seed = todo[0]
                if stop is not None and stop.requested:
                    raise StudyStopped(f"{stop.name} received: {grid.name} stopped before {arm} seed {seed}")
                t1 = time.monotonic()
                print(f"study[{grid.name}]: {arm} seed {seed}", flush=True)
                try:
                    run_arm(grid, arm, seed, out, urls.get(server_key(grid.configs[arm])), stop, key)
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


def run_grids(grids: Sequence[Grid], out: Path, jobs: int = 1, stop: StopSignals | None = None) -> None:
    """Run every grid; with ``jobs > 1`` independent groups of grids run concurrently (each run is a
    subprocess, so threads only wait). On a small CPU two jobs overlap one run's rollout server with
    another's trainer."""

    def work(group: list[Grid]) -> None:
        for g in group:
            spent = run_grid(g, out, stop)
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
    pool, interrupted = ThreadPoolExecutor(max_workers=jobs), False
    try:
        for f in [pool.submit(work, grp) for grp in groups]:
            f.result()
    except Interrupted:
        interrupted = True
        raise
    finally:
        # A failed grid lets the others finish; a second stop signal does not wait for the workers'
        # runs in flight (after the first, they start no new one).
        pool.shutdown(wait=not interrupted, cancel_futures=interrupted)
