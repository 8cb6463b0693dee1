"""The trainer world: torch.distributed + Megatron's parallel layout, and the helpers every phase uses.

:func:`init_distributed` starts the default group from torchrun / srun variables (gloo on CPU, NCCL
on GPU; its store listens on ``MASTER_ADDR`` only) and Megatron's TP / PP / EP / DP groups;
:func:`log0` prints on the driver rank, :func:`broadcast_object` sends rank 0's Python object to
every rank, and :func:`any_rank` makes one rank's flag every rank's (the stop signal).
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from megatron_acrl.config import Config, ConfigError


def log0(*msg: object) -> None:
    """Print on the driver rank only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*msg, file=sys.stderr, flush=True)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from ``src`` on every rank of the world (pickled); ``obj`` itself in a single process
    (no process group: unit tests of the driver's phases)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank (one tiny all-reduce), e.g. a stop signal
    that reached one rank: all ranks must leave the loop at the same step."""
    box = torch.tensor([1.0 if flag else 0.0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return bool(box.item() > 0)


def _default_store(env: os._Environ[str], timeout: datetime.timedelta) -> dict[str, Any]:
    """``init_process_group`` arguments that put the default group's store where the ranks dial it
    and nowhere else: rank 0 hosts it on ``MASTER_ADDR``'s address (loopback in a local run, the
    first trainer node's interface in a job), where the ``env://`` rendezvous would listen on every
    interface. Under torchrun the agent hosts the store (``python -m launch.torchrun`` binds it the
    same way) and the ranks only dial it: nothing to do."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return {}
    from torch.distributed import PrefixStore

    from sglang_bridge.listeners import BoundTCPStore

    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    store = BoundTCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, rank == 0, timeout, multi_tenant=True
    )
    # The same key space as env:// (init_process_group prefixes the store it makes itself).
    return {"store": PrefixStore("default_pg", store), "rank": rank, "world_size": world}


def init_distributed(cfg: Config) -> tuple[int, int]:
    """Initialise the default group from torchrun/srun variables (or a 1-rank world) and Megatron."""
    from megatron_acrl.megatron import cpu_compat
    from megatron_acrl.megatron.base import initialize_parallel

    if not dist.is_initialized():
        env = os.environ
        if "RANK" not in env and "SLURM_PROCID" in env:  # srun without torchrun
            env.setdefault("RANK", env["SLURM_PROCID"])
            env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
            env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
        env.setdefault("RANK", "0")
        env.setdefault("WORLD_SIZE", "1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env:
            from sglang_bridge.server import free_port

            env["MASTER_PORT"] = str(free_port())
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(minutes=30)
        dist.init_process_group(backend, timeout=timeout, **_default_store(env, timeout))
    world = dist.get_world_size()
    p = cfg.parallel
    if p.world_size is not None and p.world_size != world:
        raise ConfigError(
            [("parallel.world_size", f"config says {p.world_size} but {world} ranks were launched")]
        )
    p.data_parallel_size(world)  # raises a ConfigError naming the layout if inconsistent
    cpu_compat.apply()  # the CPU/gloo patches, once per process (a no-op with CUDA)
    initialize_parallel(p, cfg.training.seed)
    return dist.get_rank(), world
