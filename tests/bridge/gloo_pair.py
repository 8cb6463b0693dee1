"""A weight-update group of spawned test ranks, built as the bridge builds it and torn down cleanly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from sglang_bridge.weight_sync import create_update_group


@contextlib.contextmanager
def gloo_group(rank: int, port: int, name: str, world: int = 2) -> Iterator[dist.ProcessGroup]:
    """Rank ``rank`` of a ``world``-rank gloo group on ``127.0.0.1:port`` (rank 0 hosts its store).

    Torn down on the way out, after a barrier when the ranks' work succeeded: a rank that exits with
    the group alive leaves gloo's threads to the interpreter's exit, which aborted a rank once under
    load (SIGABRT, "terminate called without an active exception")."""
    group = create_update_group("gloo", "127.0.0.1", port, world, rank, name, timedelta(seconds=60))
    try:
        yield group
        dist.barrier(group=group)  # no rank tears down while another still uses the group
    finally:
        dist.destroy_process_group(group)
