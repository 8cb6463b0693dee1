"""``torchrun`` whose TCP stores listen only where its ranks dial them.

    python -m launch.torchrun --standalone --nproc-per-node 2 -m megatron_acrl.train --config ...
    python -m launch.torchrun --nnodes 4 --node-rank $N --master-addr node1 --master-port P ...

Same arguments as ``python -m torch.distributed.run``. torch's agent hosts two stores (the
rendezvous store and the one its ranks bootstrap from) and each ``TCPStore`` server listens on every
interface, whatever address it is reached at. Here the agent builds them as
:class:`sglang_bridge.listeners.BoundTCPStore`: bound to that address only, loopback for
``--standalone`` (the ranks' store is announced at ``--local-addr``, 127.0.0.1 unless given), the
master's interface in a multi-node job. The ranks themselves only dial the agent's store.
"""

from __future__ import annotations

import sys


def bind_agent_stores() -> None:
    """Make this process's torchrun agent build its stores as ``BoundTCPStore`` (the launcher's own
    process only: called by :func:`main`, never at import)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    from sglang_bridge.listeners import BoundTCPStore

    dist.TCPStore = BoundTCPStore  # type: ignore[misc]  # dynamic_rendezvous: the ranks' store
    c10d_rendezvous_backend.TCPStore = BoundTCPStore  # type: ignore[misc]  # --standalone / c10d
    static_tcp_rendezvous.TCPStore = BoundTCPStore  # type: ignore[misc]  # --master-addr


def standalone_args(argv: list[str]) -> list[str]:
    """``argv`` with ``--local-addr 127.0.0.1`` added for a ``--standalone`` run that names none:
    the ranks' store is then announced, and bound, on loopback rather than at the host's name."""
    flags = [a.split("=", 1)[0] for a in argv]
    if "--standalone" in flags and not {"--local-addr", "--local_addr"} & set(flags):
        return ["--local-addr", "127.0.0.1", *argv]
    return argv


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run

    bind_agent_stores()
    run.main(standalone_args(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
