"""Stand-in trainer for the SLURM launch tests: the driver's CLI and contract, no model.

    python -m tests.launch_standin_trainer --config run/submitted-config.yaml --run-dir run [k=v ...]

THE REAL DRIVER PLUGS IN HERE: the launch tests submit with ``--entry-module
tests.launch_standin_trainer``; production jobs use the default ``--entry-module
megatron_acrl.train``, which keeps the same contract (``megatron_acrl/config/exit_codes.py``):

* one process per rank, meeting at MASTER_ADDR:MASTER_PORT with RANK / WORLD_SIZE (like
  torch.distributed's env://; a few-line TCP group here because importing torch costs ~5 s per rank
  on a loaded 2-core CI machine and the launch tests start many jobs);
* with ``rollout.server_urls`` the servers are probed with the key from ``rollout.api_key_env``;
* SIGTERM on any rank -> all ranks agree at the next step boundary, rank 0 writes the checkpoint,
  barrier, exit 0; a resumed run (``training.resume``) continues from ``checkpoint_dir/latest.json``.

Test knobs (environment, inherited through sbatch/srun): STANDIN_STEP_S (seconds per step),
STANDIN_FAIL_RANK + STANDIN_FAIL_STEP (that rank exits 3 at that step), STANDIN_HOLD_AT_STEP (on the
first run, rank 0 waits at that step until SIGTERM arrives, so a test can signal "mid-run"
deterministically).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from megatron_acrl.config import ConfigError, load_config
from sglang_bridge.server import probe

_STOP = False


class TinyGroup:
    """All-reduce and barrier over TCP: rank 0 listens on MASTER_ADDR:MASTER_PORT, the others connect."""

    def __init__(self, rank: int, world: int, addr: str, port: int, timeout_s: float = 120.0):
        self.rank, self.world = rank, world
        self.peers: list = []
        if world == 1:
            return
        if rank == 0:
            srv = socket.create_server((addr, port), reuse_port=False)
            srv.settimeout(timeout_s)
            for _ in range(world - 1):
                conn, _ = srv.accept()
                self.peers.append(conn.makefile("rw"))
            srv.close()
        else:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    conn = socket.create_connection((addr, port), timeout=timeout_s)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            self.peers.append(conn.makefile("rw"))

    def all_reduce(self, value: float, op: str = "sum") -> float:
        if self.world == 1:
            return value
        if self.rank == 0:
            lines = [f.readline() for f in self.peers]
            if not all(lines):
                raise ConnectionError("a peer rank went away")
            vals = [value] + [float(x) for x in lines]
            out = sum(vals) if op == "sum" else max(vals)
            for f in self.peers:
                f.write(f"{out}\n")
                f.flush()
            return out
        f = self.peers[0]
        f.write(f"{value}\n")
        f.flush()
        line = f.readline()
        if not line:
            raise ConnectionError("rank 0 went away")
        return float(line)

    def barrier(self) -> None:
        self.all_reduce(0.0)


def _on_term(_sig: int, _frame: object) -> None:
    global _STOP
    _STOP = True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_term)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    group = TinyGroup(rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    run_dir = Path(args.run_dir)
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    print(f"rank {rank}/{world} master={master} restart={restart}")

    if rank == 0 and cfg.rollout.server_urls:
        key = os.environ.get(cfg.rollout.api_key_env) if cfg.rollout.api_key_env else None
        for url in cfg.rollout.server_urls:
            ok, what, _ = probe(url, key)
            if not ok:
                print(f"server {url} not usable: {what}", file=sys.stderr)
                return 1
        print(f"servers ok: {list(cfg.rollout.server_urls)} key={'yes' if key else 'no'}", flush=True)

    ckpt_dir = Path(cfg.training.checkpoint_dir or run_dir / "checkpoints")
    latest = ckpt_dir / "latest.json"
    start = json.loads(latest.read_text())["step"] if (cfg.training.resume and latest.exists()) else 0
    if start:
        print(f"resumed from step {start}", flush=True)
    step_s = float(os.environ.get("STANDIN_STEP_S", "0.1"))
    fail_rank = int(os.environ.get("STANDIN_FAIL_RANK", "-1"))
    fail_step = int(os.environ.get("STANDIN_FAIL_STEP", "-1"))
    hold_at = int(os.environ.get("STANDIN_HOLD_AT_STEP", "-1"))

    for step in range(start, cfg.training.num_steps):
        if rank == fail_rank and step == fail_step:
            print(f"rank {rank}: injected failure at step {step}", file=sys.stderr, flush=True)
            return 3
        time.sleep(step_s)
        assert group.all_reduce(float(step)) == step * world
        if rank == 0:
            with open(run_dir / "progress.jsonl", "a") as f:
                f.write(json.dumps({"step": step + 1, "restart": restart}) + "\n")
            if step + 1 == hold_at and restart == 0:
                deadline = time.monotonic() + 120
                while not _STOP and time.monotonic() < deadline:
                    time.sleep(0.05)
        # Every rank stops at the same step, like the driver's all-reduced stop flag.
        if group.all_reduce(1.0 if _STOP else 0.0, op="max") > 0:
            step += 1
            if rank == 0:
                ckpt_dir.mkdir(parents=True, exist_ok=True)
                tmp = ckpt_dir / "latest.json.tmp"
                tmp.write_text(json.dumps({"step": step}))
                tmp.replace(latest)
                print(f"checkpoint at step {step} after SIGTERM", flush=True)
            group.barrier()
            return 0
    step = cfg.training.num_steps
    if rank == 0:
        (run_dir / "standin-done.json").write_text(
            json.dumps(
                {"final_step": step, "world": world, "master": os.environ["MASTER_ADDR"], "restart": restart}
            )
        )
        print(f"run finished at step {step}", flush=True)
    group.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
