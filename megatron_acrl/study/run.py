"""Running the study: one training run per arm x seed, a grid's shared servers, grids side by side.

Every run is ``python -m megatron_acrl.train`` in its own process (torchrun when the grid has several
ranks) in ``<out>/<arm>-s<seed>``; a run that finished with the same overrides is reused. A grid's
shared SGLang servers (one per KV-cache dtype of its arms) outlive its runs: each run pushes its own
initial weights first. With ``--jobs N`` independent groups of grids run in N threads; with fewer
groups than jobs, a group's seeds are split into shards that run side by side, each shard with its
own servers (two runs never share a server: each pushes its own weights).

A run that fails twice (the second time on a fresh server) is recorded as failed (``<run>/failed``:
its exit code and the tail of its log) and the grid goes on; :func:`run_grids` returns the failed
runs. Each finished run's ``done`` marker holds its wall time and the CPU seconds it cost: the
trainer's process tree and the server's (the load-independent figure the study is sized by).

Stopping: the study's entry point passes its :class:`~megatron_acrl.world.signals.StopSignals`; after a
first SIGTERM / SIGINT no new run starts, and a run that ends while a stop is requested is not
marked finished (it may have been stopped with the study, e.g. by the same Ctrl-C).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from megatron_acrl.config import Config
from megatron_acrl.study.grid import Grid, grid_groups
from megatron_acrl.world.signals import Interrupted, StopSignals
from sglang_bridge.server_key import new_api_key


class StudyStopped(Exception):
    """A stop signal reached the study: the runs finished so far are kept, nothing else starts."""


def server_model_dir(grid: Grid) -> str:
    """The directory the grid's shared server loads: any checkpoint of the architecture will do,
    since every run overwrites all weights before its first rollout."""
    cfg = next(iter(grid.configs.values()))
    if cfg.model.hf_path:
        return cfg.model.hf_path
    from megatron_acrl.warmstart.tiny_model import build_checkpoint

    return str(build_checkpoint(cfg.model, seed=grid.seeds[0]))


def server_key(cfg: Config) -> str:
    """What a shared server must be launched with for this run: its KV-cache dtype (the FP8 KV
    emulation is a launch-time patch); everything else a run needs arrives with its weights."""
    return cfg.rollout.kv_cache_dtype


SERVER_KEY_ENV = "ACRL_SGLANG_API_KEY"
"""The variable a run on a grid's shared servers finds their key in (``rollout.api_key_env``)."""


@contextlib.contextmanager
def shared_servers(grid: Grid, log_dir: Path, api_key: str, tag: str = "") -> Iterator[dict[str, Any]]:
    """SGLang CPU servers for the grid, one per distinct :func:`server_key` of its arms (a BF16-KV
    baseline and FP8-KV arms need two); empty when the grid starts a server per run. The servers
    sleep while idle, so a grid's idle second server costs no CPU. They demand ``api_key``, which
    only the grid's runs are given. Yields ``{key: SGLangServer}``; ``tag`` names the logs of one
    seed shard's servers."""
    cfg = next(iter(grid.configs.values()))
    if not grid.shared_server or cfg.rollout.server_urls or cfg.rollout.backend != "sglang":
        yield {}
        return
    from megatron_acrl.servers.transfer import resolve_device
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
            suffix = ("" if key == "auto" else f"_kv_{key}") + tag
            server = SGLangServer(
                spec,
                log_dir / f"sglang_{grid.name}{suffix}.log",
                startup_timeout_s=cfg.rollout.startup_timeout_s,
            )
            stack.callback(server.stop)
            server.start()
            urls[key] = server
        yield urls


def tree_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its descendants (0 if gone)."""
    if pid is None:
        return 0.0
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _run_process(cmd: list[str], log_path: Path, env: dict[str, str]) -> tuple[int, float]:
    """Run ``cmd`` to the end with its output in ``log_path``; returns (exit code, CPU seconds of
    its process tree, from ``wait4``: every descendant it waited for is included)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def run_arm(
    grid: Grid,
    arm: str,
    seed: int,
    out: Path,
    server: Any = None,
    stop: StopSignals | None = None,
    server_api_key: str | None = None,
) -> Path:
    """One training run on ``server`` (a shared :class:`SGLangServer`, or None: the run starts its
    own); returns its run directory (reused when it finished with the same overrides). Raises
    :class:`StudyStopped` when ``stop`` was requested while it ran (no ``done`` marker)."""
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
    if server is not None:  # the key travels in the environment, never on the command line
        cmd_overrides += [f'rollout.server_urls=["{server.url}"]', f"rollout.api_key_env={SERVER_KEY_ENV}"]
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
    t0, server_cpu0 = time.monotonic(), tree_cpu_s(server.pid if server is not None else None)
    rc, cpu = _run_process([*cmd, *cmd_overrides], run_dir / "train.log", env)
    if stop is not None and stop.requested:
        raise StudyStopped(f"study run {arm} seed {seed} ended under {stop.name} (rc={rc}); not kept")
    if rc != 0:
        (run_dir / "failed").write_text(
            json.dumps({**key, "rc": rc, "log_tail": _tail(run_dir / "train.log")})
        )
        raise RuntimeError(f"study run {arm} seed {seed} failed (rc={rc}); see {run_dir / 'train.log'}")
    server_cpu = tree_cpu_s(server.pid if server is not None else None) - server_cpu0
    marker = {**key, "wall_s": time.monotonic() - t0, "trainer_cpu_s": cpu, "server_cpu_s": server_cpu}
    done.write_text(json.dumps(marker) + "\n")
    return run_dir


def _tail(path: Path, n: int = 12) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    return ""


def run_grid(
    grid: Grid, out: Path, stop: StopSignals | None = None, tag: str = ""
) -> tuple[float, list[tuple[str, int]]]:
    """Every arm x seed of ``grid`` (seed-major, so a partial grid already has whole seeds);
    returns the wall seconds spent and the runs that failed. A failed run gets one retry on a fresh
    server; failing again it is recorded (module doc) and the grid goes on."""
    t0 = time.monotonic()
    todo = [(arm, seed) for seed in grid.seeds for arm in grid.arms if seed in grid.seeds_of(arm)]
    out.mkdir(parents=True, exist_ok=True)
    retried: set[tuple[str, int]] = set()
    failed: list[tuple[str, int]] = []
    while todo:
        key = new_api_key()  # one per set of shared servers
        with shared_servers(grid, out, key, tag) as servers:
            while todo:
                arm, seed = todo[0]
                if stop is not None and stop.requested:
                    raise StudyStopped(f"{stop.name} received: {grid.name} stopped before {arm} seed {seed}")
                t1 = time.monotonic()
                print(f"study[{grid.name}]: {arm} seed {seed}", flush=True)
                try:
                    run_arm(grid, arm, seed, out, servers.get(server_key(grid.configs[arm])), stop, key)
                except RuntimeError as err:
                    if (arm, seed) not in retried:
                        print(f"study[{grid.name}]: {err}; retrying on a fresh server", flush=True)
                        retried.add((arm, seed))
                        break  # leave the with-block: the server is restarted, the run retried
                    print(f"study[{grid.name}]: {err} again; recorded as failed, going on", flush=True)
                    failed.append((arm, seed))
                todo.pop(0)
                print(
                    f"study[{grid.name}]: {arm} seed {seed} done in {time.monotonic() - t1:.0f}s", flush=True
                )
    return time.monotonic() - t0, failed


def seed_shards(groups: list[list[Grid]], jobs: int) -> list[tuple[list[Grid], str]]:
    """Work units for ``jobs`` workers: each group of grids whole, or, with fewer groups than jobs,
    split by seeds (round robin) into shards of the same grids restricted to their seeds; each unit
    with the tag its servers' logs carry."""
    per_group = max(1, -(-jobs // max(len(groups), 1)))
    units = []
    for grp in groups:
        seeds = sorted({s for g in grp for s in g.seeds})
        n = min(per_group, len(seeds))
        if n <= 1:
            units.append((grp, ""))
            continue
        for k in range(n):
            mine = set(seeds[k::n])
            shard = [dataclasses.replace(g, seeds=tuple(s for s in g.seeds if s in mine)) for g in grp]
            units.append(([g for g in shard if g.seeds], f"_shard{k}"))
    return units


def run_grids(
    grids: Sequence[Grid], out: Path, jobs: int = 1, stop: StopSignals | None = None
) -> list[tuple[str, int]]:
    """Run every grid; returns the runs that failed (arm, seed). With ``jobs > 1`` independent work
    units (:func:`seed_shards`) run concurrently (each run is a subprocess, so threads only wait).
    On a small CPU two jobs overlap one run's rollout server with another's trainer."""
    failed: list[tuple[str, int]] = []

    def work(unit: tuple[list[Grid], str]) -> None:
        group, tag = unit
        for g in group:
            spent, bad = run_grid(g, out, stop, tag)
            failed.extend(bad)
            print(f"study[{g.name}{tag}]: grid finished in {spent / 60:.1f} min", flush=True)

    units = seed_shards(grid_groups(grids), jobs) if jobs > 1 else [(grp, "") for grp in grid_groups(grids)]
    if jobs <= 1 or len(units) == 1:
        for unit in units:
            work(unit)
        return failed
    # Heavy imports (transformers' lazy modules deadlocked when first imported from several threads
    # at once) and the servers' checkpoints happen here, in the main thread, before the workers.
    import megatron_acrl.servers.handle  # noqa: F401
    import sglang_bridge.server  # noqa: F401

    for g in grids:
        if g.shared_server:
            server_model_dir(g)
    # Largest units first, each worker taking the next unit when free.
    units.sort(key=lambda u: -sum(len(g.arms) * len(g.seeds) for g in u[0]))
    pool, interrupted = ThreadPoolExecutor(max_workers=jobs), False
    try:
        for f in [pool.submit(work, unit) for unit in units]:
            f.result()
    except Interrupted:
        interrupted = True
        raise
    finally:
        # A failed grid lets the others finish; a second stop signal does not wait for the workers'
        # runs in flight (after the first, they start no new one).
        pool.shutdown(wait=not interrupted, cancel_futures=interrupted)
    return failed
