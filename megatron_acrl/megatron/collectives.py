"""The correction's collectives: partial metrics all-reduced over a process group.

The correction itself (``megatron_acrl.correction``) is pure torch and never calls
``torch.distributed``; its partial metrics say how they combine by their key's suffix
(:func:`~megatron_acrl.correction.metrics.reduce_kind`), and this module does the reduction across
ranks, for the trainer that owns the groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_acrl.correction import reduce_kind

__all__ = ["all_reduce_partials"]


def all_reduce_partials(
    partials: dict[str, Tensor], group: dist.ProcessGroup | None = None
) -> dict[str, Tensor]:
    """All-reduce partial metrics over ``group`` (e.g. the data-parallel group), one call per kind.

    Args:
        partials: scalar partial metrics by name (the same names on every rank of ``group``).
        group: the process group; None is the default (world) group.
    Returns:
        The reduced scalars (float32), by name. ``lse`` entries are reduced exactly: all-reduce MAX
        of the values, then SUM of exp(v - max).
    """
    keys = sorted(partials)
    out: dict[str, Tensor] = {}
    by_kind: dict[str, list[str]] = {"sum": [], "max": [], "min": [], "lse": []}
    for k in keys:
        by_kind[reduce_kind(k)].append(k)
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    for kind, names in by_kind.items():
        if not names:
            continue
        flat = torch.stack([partials[k].detach().float().reshape(()) for k in names])
        if kind == "lse":
            peak = flat.clone()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            safe_peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
            scaled = torch.exp(flat - safe_peak)
            dist.all_reduce(scaled, op=dist.ReduceOp.SUM, group=group)
            flat = torch.log(scaled) + safe_peak
        else:
            dist.all_reduce(flat, op=ops[kind], group=group)
        out.update(zip(names, flat.unbind(0), strict=True))
    return out
