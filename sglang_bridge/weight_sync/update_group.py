"""The weight-update group: a torch.distributed group of the trainer (rank 0) and every server's TP
ranks, formed on both ends exactly as SGLang forms its end (``init_custom_process_group``), on
torch's private group factory, without any default process group. Rank 0's store listens on the
address the servers dial (``master_address``) only: loopback for servers on this machine
(:class:`sglang_bridge.listeners.BoundTCPStore`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from sglang_bridge.listeners import BoundTCPStore, interface_of, is_loopback
from sglang_bridge.weight_sync.interface import WeightSyncError


def host_update_store(
    master_address: str, master_port: int, world_size: int, timeout: timedelta
) -> dist.TCPStore:
    """Rank 0's TCP store of the weight-update group, bound *before* any server is told its port.

    ``master_port=0`` lets the OS pick a free port at bind time (read it back from ``store.port``).
    Picking a "free" port first and binding it later is racy: another process (a server starting
    next to us takes several ports for its own IPC) can take it in between, and the servers would
    then dial whatever took it. It listens on ``master_address`` only, not on every interface.
    """
    try:
        return BoundTCPStore(
            master_address, master_port, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
    except (RuntimeError, OSError) as e:
        raise WeightSyncError(
            f"cannot host the weight-update store on {master_address}:{master_port} ({e}); leave "
            "master_port unset to let the OS pick a free port, or choose one that is free"
        ) from e


def create_update_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """The trainer's end of the weight-update group, built exactly like SGLang's server end.

    SGLang's ``init_custom_process_group`` does a TCP rendezvous, wraps the store in
    ``PrefixStore(group_name)`` and calls torch's group factory; the store keys must match on both
    ends, so we do the same (rank 0 hosts the TCP store). No default process group is needed or
    touched: the group is passed explicitly to every collective.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    # A TCPStore built directly, not dist.rendezvous("tcp://..."): under torchrun the rendezvous
    # handler sees TORCHELASTIC_USE_AGENT_STORE and joins the *agent's* store as a client instead of
    # hosting this one, so trainer and servers would all wait for a host that never comes.
    if store is None:  # ``store``: one already hosted by :func:`host_update_store`
        store = BoundTCPStore(
            master_address,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    store = PrefixStore(group_name, store)
    with gloo_device_on(master_address if rank == 0 else None, backend):
        pg, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(backend),
            store,
            group_name=group_name,
            backend_options=None,
            timeout=timeout,
        )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@contextlib.contextmanager
def gloo_device_on(address: str | None, backend: str) -> Iterator[None]:
    """Create a gloo group's device on the interface that holds ``address``, the one the servers dial.

    gloo binds, and tells its peers to dial, the interface ``GLOO_SOCKET_IFNAME`` names, else the
    address this host's name resolves to: on many machines 127.0.0.1 or 127.0.1.1, which a server on
    another node cannot reach even though the store it rendezvoused at (``address``) is reachable.
    So unless the user set ``GLOO_SOCKET_IFNAME``, it is set to ``address``'s interface while the
    group is made (gloo reads it then) and removed after. A loopback or non-local address, or another
    backend (NCCL picks its interfaces itself), changes nothing.
    """
    ifname = None
    if (
        backend == "gloo"
        and address
        and not is_loopback(address)
        and not os.environ.get("GLOO_SOCKET_IFNAME")
    ):
        ifname = interface_of(address)
    if ifname is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def broadcast_async(tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Start a broadcast of ``tensor`` from group rank 0; returns the work handle."""
    return dist.broadcast(tensor, src=0, group=group, async_op=True)
