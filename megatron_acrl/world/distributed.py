"""The trainer world: torch.distributed + Megatron's parallel layout, and the helpers every phase uses.

:func:`init_distributed` starts the default group from torchrun / srun variables (gloo on CPU, NCCL
on GPU; its store listens on ``MASTER_ADDR`` only) and Megatron's TP / PP / EP / DP groups;
:func:`log0` prints on the driver rank, :func:`broadcast_object` sends rank 0's Python object to
every rank, and :func:`any_rank` makes one rank's flag every rank's (the stop signal).

A refusal of rank 0 alone after start-up (its server port held by another process, an unreachable
``rollout.server_urls`` entry: only rank 0 starts or reaches the servers) is shared, not left to
break the others' next collective with a raw gloo traceback: rank 0 writes its exit code into the
world's store and tears its process groups down (:func:`share_refusal`), so every other rank's
pending collective fails at once; each reads the code (:func:`rank0_refusal`), prints one line that
points at rank 0's message and exits with the same code, which ``launch.torchrun`` passes on.
"""

from __future__ import annotations

import contextlib
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


REFUSED_KEY = "acrl/rank0_refused"
"""The store key rank 0's exit code is written under when it refuses alone (module doc)."""

READ_KEY = "acrl/refusal_read/"
"""+ rank: that rank read rank 0's refusal (rank 0 waits for these before it exits: its store may
be the world's, and would go with it)."""

REFUSAL_READ_S = 10.0
"""How long rank 0 waits for the other ranks to read its refusal (one busy elsewhere reads it later
from the launcher's store, which outlives rank 0 under torchrun)."""


def _world_store() -> Any | None:
    """The default group's store, or None outside a multi-rank world."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def share_refusal(code: int, wait_s: float = REFUSAL_READ_S) -> int:
    """Rank 0, refusing the run (its message printed) with exit ``code`` after the world started:
    tell the other ranks (module doc) and return ``code``. Another rank refusing too (a bad layout,
    which every rank finds) only marks rank 0's news as read: it exits with its own message. Never
    raises: it runs on the way out."""
    store = _world_store()
    if store is None:
        return code
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        if rank != 0:
            store.set(f"{READ_KEY}{rank}", "1")
            return code
        store.set(REFUSED_KEY, str(code))
        dist.destroy_process_group()  # every rank's pending collective with this one fails now
        store.wait([f"{READ_KEY}{r}" for r in range(1, world)], datetime.timedelta(seconds=wait_s))
    except Exception:  # noqa: BLE001 - a rank that never reads it falls back to its own traceback
        pass
    return code


def rank0_refusal() -> int | None:
    """On a rank other than 0 whose run failed: rank 0's exit code when rank 0 refused the run
    (:func:`share_refusal`; one line printed saying so), else None (a failure of its own: raise it)."""
    try:
        store = _world_store()
        if store is None or dist.get_rank() == 0 or not store.check([REFUSED_KEY]):
            return None
        code, rank = int(store.get(REFUSED_KEY)), dist.get_rank()
    except Exception:  # noqa: BLE001 - no store to ask (rank 0 hosted it): the failure stands
        return None
    # Printed before rank 0 is told it was read: once rank 0 exits, the launcher stops this rank.
    print(
        f"rank {rank}: stopped because rank 0 refused the run (exit {code}); see rank 0's message above",
        file=sys.stderr,
        flush=True,
    )
    with contextlib.suppress(Exception):
        store.set(f"{READ_KEY}{rank}", "1")
    return code


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
