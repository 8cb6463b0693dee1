"""HF weights in and out of Megatron model chunks: one stream, one reader, one writer.

* Stream (:func:`hf_weights`): this rank's parameters gathered over TP / expert-TP / EP (and, with
  ``all_stages``, broadcast over the pipeline group) into full tensors under HF names, one tensor at
  a time. The writer saves it; the rank-0 weight sync (``rollout.weight_sync: rank0``) sends it.
* Per-source stream (:func:`source_weights`, :func:`source_meta`, :class:`SyncSource`): what one
  weight-sync source sends -- the (DP 0, TP 0) rank of each pipeline stage its stage's tensors, each
  EP rank's (expert-DP 0, expert-TP 0) rank its own experts -- gathered over TP / expert-TP onto the
  source only; nothing crosses the pipeline or expert-parallel group. Its metadata comes without
  any gather, so every source's update is checked before a byte is sent.
* Reader (:func:`load_hf`): every rank reads from a safetensors file, an HF directory or a mapping
  only the HF tensors its own shards need, and copies its TP / EP slice into the parameters.
* Writer (:func:`write_hf_dir`): an HF model directory (``config.json`` or the base model's
  config and tokenizer, safetensors shards), written atomically by one rank while every rank walks
  the stream.

The Megatron <-> HF name and layout tables are ``convert``'s; which table applies to a parameter
is the model's business (``to_hf`` / ``from_hf`` callables: the critic maps its value head itself).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_acrl.megatron import convert
from megatron_acrl.megatron.model import unwrap

__all__ = [
    "HfSource",
    "ParamLayout",
    "SyncSource",
    "hf_getter",
    "hf_weights",
    "load_hf",
    "source_meta",
    "source_weights",
    "sync_source",
    "write_hf_dir",
]

HfSource = str | os.PathLike | Mapping[str, torch.Tensor]
"""A safetensors file, an HF model directory, or a mapping HF name -> full tensor."""

ToHf = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]
"""Full canonical Megatron tensor ``(name, tensor)`` -> its HF ``(name, tensor)`` pairs."""

FromHf = Callable[[str, Callable[[str], torch.Tensor]], torch.Tensor]
"""Canonical Megatron name and ``get(hf_name)`` -> the full canonical Megatron tensor."""


@dataclass(frozen=True)
class ParamLayout:
    """Where this rank's parameters sit in the full model: what the gathers and offsets need.

    Args:
        config: the chunks' ``TransformerConfig`` (pipeline layer offsets).
        pg: the process groups the chunks were built with (TP, expert-TP, EP, PP).
        num_experts: experts of the full model (0: dense).
        virtual_pipeline: whether the chunks are virtual pipeline stages (``parallel.vpp`` set).
    """

    config: TransformerConfig
    pg: ProcessGroupCollection
    num_experts: int
    virtual_pipeline: bool

    @property
    def local_experts(self) -> int:
        """Experts held by each EP rank."""
        return self.num_experts // self.pg.ep.size() if self.num_experts else 0


@dataclass
class _Entry:
    """One local parameter and how to turn it into full canonical tensor(s)."""

    param: torch.nn.Parameter
    local_name: str  # canonical name with layer offset applied, local expert index
    is_expert: bool
    names: list[str]  # canonical names of the full tensors it yields (several for EP)


def _local_params(
    model: list[torch.nn.Module], layout: ParamLayout
) -> Iterator[tuple[torch.nn.Module, str, torch.nn.Parameter, bool]]:
    """``(GPTModel, canonical name with the layer offset, parameter, is_expert)`` of every local
    parameter, chunk by chunk (the same order on every rank of a stage)."""
    for vp_stage, chunk in enumerate(model):
        offset = get_transformer_layer_offset(
            layout.config,
            vp_stage=vp_stage if layout.virtual_pipeline else None,
            pp_rank=layout.pg.pp.rank(),
        )
        gpt = unwrap(chunk)
        for name, param in gpt.named_parameters():
            if "_lora." in name:  # LoRA adapters (``lora.SUFFIX``): lora.py's own exporters handle them
                continue
            is_expert = not getattr(param, "allreduce", True)
            yield gpt, convert.canonical_name(name, layer_offset=offset), param, is_expert


def _entries(model: list[torch.nn.Module], layout: ParamLayout) -> list[_Entry]:
    """Local parameters with the canonical names of the full tensors they yield."""
    ep_size, n_local = layout.pg.ep.size(), layout.local_experts
    entries = []
    for gpt, local, param, is_expert in _local_params(model, layout):
        if local == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
            continue  # the tied copy on the last stage; exported from the embedding
        if is_expert:
            names = [convert.canonical_name(local, expert_offset=r * n_local) for r in range(ep_size)]
        else:
            names = [local]
        entries.append(_Entry(param, local, is_expert, names))
    return entries


def _tp_group(entry: _Entry, pg: ProcessGroupCollection) -> dist.ProcessGroup:
    return pg.expt_tp if entry.is_expert else pg.tp


def _gather_full(entry: _Entry, pg: ProcessGroupCollection) -> list[torch.Tensor]:
    """Full tensors of one entry (collective over TP, expert-TP and EP groups of this stage)."""
    t = entry.param.detach()
    if getattr(entry.param, "tensor_model_parallel", False):
        group = _tp_group(entry, pg)
        if group.size() > 1:
            shards = [torch.empty_like(t) for _ in range(group.size())]
            dist.all_gather(shards, t.contiguous(), group=group)
            t = convert.tp_merge(entry.local_name, shards, entry.param.partition_dim)
    if entry.is_expert and pg.ep.size() > 1:
        parts = [torch.empty_like(t) for _ in range(pg.ep.size())]
        dist.all_gather(parts, t.contiguous(), group=pg.ep)
        return parts
    return [t]


def hf_weights(
    model: list[torch.nn.Module], layout: ParamLayout, to_hf: ToHf, *, all_stages: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, full tensor)`` pairs, one tensor at a time, gathered from TP/EP shards.

    Every rank must iterate (the gathers are collectives). With ``all_stages=False`` a rank yields
    the tensors of its own pipeline stage (what per-stage weight sync needs: the (DP0, TP0) rank of
    each stage sends); with ``all_stages=True`` every rank yields the whole model, stage by stage
    (tensors are broadcast over the pipeline group). Tensors keep the model's dtype and must be
    treated as read-only.
    """
    entries = _entries(model, layout)
    if not all_stages or layout.pg.pp.size() == 1:
        for e in entries:
            for name, full in zip(e.names, _gather_full(e, layout.pg), strict=True):
                yield from to_hf(name, full)
        return
    yield from _all_stage_weights(entries, layout.pg, to_hf)


def _all_stage_weights(
    entries: list[_Entry], pg: ProcessGroupCollection, to_hf: ToHf
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's full tensors on every rank: each stage broadcasts its own over the pipeline."""
    # Shapes/dtypes of every stage's full tensors, so receivers can allocate.
    plan = []
    for e in entries:
        shape = list(e.param.shape)
        if getattr(e.param, "tensor_model_parallel", False):
            shape[e.param.partition_dim] *= _tp_group(e, pg).size()
        plan.append((e.names, shape, str(e.param.dtype).replace("torch.", "")))
    plans: list[Any] = [None] * pg.pp.size()
    dist.all_gather_object(plans, plan, group=pg.pp)
    for stage in range(pg.pp.size()):
        src = dist.get_global_rank(pg.pp, stage)
        mine = stage == pg.pp.rank()
        for i, (names, shape, dtype) in enumerate(plans[stage]):
            fulls = (
                _gather_full(entries[i], pg)
                if mine
                else [torch.empty(shape, dtype=getattr(torch, dtype)) for _ in names]
            )
            for name, full in zip(names, fulls, strict=True):
                full = full.contiguous()
                dist.broadcast(full, src=src, group=pg.pp)
                yield from to_hf(name, full)


# --------------------------------------------------------------------------------------------
# Per-source stream (weight sync)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyncSource:
    """A rank that sends weights to the rollout servers itself: the (DP 0, TP 0) rank of a pipeline
    stage (its dense tensors and its EP rank's experts), and with EP > 1 the (expert-DP 0,
    expert-TP 0) rank of every other EP rank of the stage (its experts).

    ``index`` runs over ``pp x ep`` sources, ``stage * ep + ep_rank``; source 0 is global rank 0."""

    index: int
    count: int
    stage: int
    stages: int
    ep_rank: int
    ep_size: int
    rank: int

    @property
    def label(self) -> str:
        """How errors and reports name it: ``stage 1/2, EP rank 0/2 (rank 2)``."""
        ep = f", EP rank {self.ep_rank}/{self.ep_size}" if self.ep_size > 1 else ""
        return f"stage {self.stage}/{self.stages}{ep} (rank {self.rank})"


def sync_source(layout: ParamLayout) -> SyncSource | None:
    """This rank's :class:`SyncSource`, or None if it sends nothing itself."""
    pg = layout.pg
    moe = layout.num_experts > 0
    ep = pg.ep.size() if moe else 1
    dense = pg.tp.rank() == 0 and pg.dp.rank() == 0
    expert = moe and pg.expt_tp.rank() == 0 and pg.expt_dp.rank() == 0
    if not (dense or expert):
        return None
    ep_rank = pg.ep.rank() if moe else 0
    if dense and ep_rank != 0:  # Megatron puts a stage's first rank at EP rank 0 (tp-cp-ep-dp order)
        raise RuntimeError(f"the (DP 0, TP 0) rank of stage {pg.pp.rank()} is EP rank {ep_rank}, not 0")
    pp = pg.pp.size()
    return SyncSource(pg.pp.rank() * ep + ep_rank, pp * ep, pg.pp.rank(), pp, ep_rank, ep, dist.get_rank())


def _full_shape(entry: _Entry, pg: ProcessGroupCollection) -> list[int]:
    shape = list(entry.param.shape)
    if getattr(entry.param, "tensor_model_parallel", False):
        shape[entry.param.partition_dim] *= _tp_group(entry, pg).size()
    return shape


def _source_entries(model: list[torch.nn.Module], layout: ParamLayout) -> list[tuple[_Entry, str, bool]]:
    """Every local parameter with the canonical name it is sent under and whether this rank's
    group takes part in its gather: the dense ones in the DP-0 replica's TP group, experts (their
    own EP rank's, global expert index) in the expert-DP-0 replica's expert-TP group."""
    pg = layout.pg
    ep_rank = pg.ep.rank() if layout.num_experts else 0
    out = []
    for e in _entries(model, layout):
        if e.is_expert:
            out.append((e, e.names[ep_rank], pg.expt_dp.rank() == 0))
        else:
            out.append((e, e.local_name, pg.dp.rank() == 0))
    return out


def source_meta(
    model: list[torch.nn.Module], layout: ParamLayout, to_hf: ToHf
) -> list[tuple[str, tuple, torch.dtype]]:
    """``(hf_name, shape, dtype)`` of every tensor :func:`source_weights` yields on this rank, in
    order, without gathering anything (the conversion runs on meta tensors); empty on a rank that
    is no :class:`SyncSource`."""
    src = sync_source(layout)
    if src is None:
        return []
    out = []
    for e, name, mine in _source_entries(model, layout):
        if not mine or _tp_group(e, layout.pg).rank() != 0:
            continue
        full = torch.empty(_full_shape(e, layout.pg), dtype=e.param.dtype, device="meta")
        out += [(n, tuple(t.shape), t.dtype) for n, t in to_hf(name, full)]
    return out


def source_weights(
    model: list[torch.nn.Module], layout: ParamLayout, to_hf: ToHf
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the ``(hf_name, full tensor)`` pairs this rank sends as a :class:`SyncSource` (nothing
    on other ranks), one tensor at a time, exactly :func:`source_meta`'s list.

    Every rank must iterate: the TP (expert-TP) shards are gathered onto the source rank of their
    group. No tensor crosses the pipeline or expert-parallel group: each stage, and each EP rank's
    experts, leave from where they live. The source holds one full tensor at a time, gathered
    straight into its buffer where the layout allows (see :func:`_gather_to_source`)."""
    pg = layout.pg
    for e, name, mine in _source_entries(model, layout):
        if not mine:
            continue
        full = _gather_to_source(e, _full_shape(e, pg), _tp_group(e, pg))
        if full is not None:
            yield from to_hf(name, full)
        del full


def _gather_to_source(entry: _Entry, shape: list[int], group: dist.ProcessGroup) -> torch.Tensor | None:
    """The full tensor of ``entry`` on the group's rank 0 (None elsewhere), gathered over its TP
    group (point to point within that group).

    Shards along dim 0 are received straight into their rows of the full tensor (the GLU
    ``linear_fc1`` as its gate and up halves); shards along another dim in row blocks of 1/size of
    the tensor, each copied into its columns. Not ``dist.gather``: gloo's gathers a flat copy of all
    shards first, a second full tensor. So the source holds at most 1 + 1/size tensors' bytes."""
    t = entry.param.detach()
    n = group.size()
    if not getattr(entry.param, "tensor_model_parallel", False) or n == 1:
        return t
    dim = entry.param.partition_dim
    if dim == 0:
        halves = 2 if convert.is_glu(entry.local_name) else 1
        parts = [p.contiguous() for p in t.chunk(halves, 0)]
        if group.rank() != 0:
            return _send_to_root(parts, group)
        full = torch.empty(shape, dtype=t.dtype, device=t.device)
        into = [list(h.chunk(n, 0)) for h in full.chunk(halves, 0)]  # into[half][rank]
        _receive(parts, into, group)
        return full
    rows = t.shape[0]
    block = -(-rows // n)
    blocks = [t[r0 : r0 + block].contiguous() for r0 in range(0, rows, block)]
    if group.rank() != 0:
        return _send_to_root(blocks, group)
    full = torch.empty(shape, dtype=t.dtype, device=t.device)
    for b, part in zip(range(0, rows, block), blocks, strict=True):
        bufs = [[torch.empty_like(part) for _ in range(n)]]
        _receive([part], bufs, group)
        for r, buf in enumerate(bufs[0]):
            full[b : b + block].narrow(dim, r * part.shape[dim], part.shape[dim]).copy_(buf)
        del bufs
    return full


def _send_to_root(parts: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """A non-root rank's side of :func:`_gather_to_source`: each part to the group's rank 0."""
    for part in parts:
        dist.send(part, dst=dist.get_global_rank(group, 0), group=group)


def _receive(own: list[torch.Tensor], into: list[list[torch.Tensor]], group: dist.ProcessGroup) -> None:
    """The root's side: ``into[i][r]`` gets part ``i`` of group rank ``r`` (its own from ``own``)."""
    for part, dests in zip(own, into, strict=True):
        dests[0].copy_(part)
        works = [
            dist.irecv(d, src=dist.get_global_rank(group, r), group=group) for r, d in enumerate(dests) if r
        ]
        for w in works:
            w.wait()


# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------


def hf_getter(source: HfSource) -> tuple[Callable[[str], torch.Tensor], Callable[[], None]]:
    """``(get(name) -> tensor, close())`` over a mapping, a .safetensors file or an HF directory."""
    if isinstance(source, Mapping):
        return source.__getitem__, lambda: None
    from safetensors import safe_open

    path = Path(source)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {k: h for h in handles for k in h.keys()}  # noqa: SIM118 - safe_open has no __iter__

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise KeyError(f"{name} not found in {path}")
        return where[name].get_tensor(name)

    return get, lambda: handles.clear()


def load_hf(model: list[torch.nn.Module], layout: ParamLayout, source: HfSource, from_hf: FromHf) -> None:
    """Copy HF weights from ``source`` into ``model``'s parameters; each rank reads only the HF
    tensors its shards need. Raises ValueError naming the parameter on a shape mismatch."""
    get, close = hf_getter(source)
    try:
        _load_into(model, layout, get, from_hf)
    finally:
        close()


@torch.no_grad()
def _load_into(
    model: list[torch.nn.Module], layout: ParamLayout, get: Callable[[str], torch.Tensor], from_hf: FromHf
) -> None:
    pg = layout.pg
    expert_offset = pg.ep.rank() * layout.local_experts
    for _gpt, local, param, is_expert in _local_params(model, layout):
        canon = convert.canonical_name(local, expert_offset=expert_offset) if is_expert else local
        full = from_hf(canon, get)
        if getattr(param, "tensor_model_parallel", False):
            group = pg.expt_tp if is_expert else pg.tp
            full = convert.tp_shard(canon, full, group.size(), group.rank(), param.partition_dim)
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(
                f"{canon}: HF weights give shape {tuple(full.shape)}, the model has {tuple(param.shape)}"
            )
        param.copy_(full)


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------


def write_hf_dir(
    weights: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    *,
    write: bool,
    config: Mapping[str, Any] | None = None,
    base_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 << 30,
    keep_existing: bool = False,
) -> Path:
    """Write ``weights`` as an HF model directory ``out_dir``; returns it.

    Every rank calls it and walks ``weights`` (the stream's gathers are collectives); only the rank
    with ``write`` keeps and writes anything, holding at most one shard in memory. The directory is
    built in a directory of this process's own (``<out_dir>.tmp-<host>-<pid>``) and renamed into
    place (replacing ``out_dir``), so a reader never sees a half-written model and two writers of
    the same directory never write into, or delete, each other's.

    Args:
        weights: ``(hf_name, tensor)`` pairs, e.g. :func:`hf_weights` with ``all_stages=True``.
        write: whether this rank writes (one rank per directory).
        config: ``config.json`` content (written last, over ``base_dir``'s).
        base_dir: an HF model directory whose files other than weights (config, tokenizer, chat
            template) are copied.
        dtype: cast the tensors (None: keep the model's dtype).
        max_shard_bytes: a new safetensors shard starts past this size. One shard is saved as
            ``model.safetensors``; several as ``model-<i>.safetensors`` with
            ``model.safetensors.index.json``.
        keep_existing: if ``out_dir`` exists once this one is written, keep it and discard this one
            (a cache entry another run finished first, which may be in use) instead of replacing it.
    """
    if not write:
        for _ in weights:
            pass
        return Path(out_dir)
    out = Path(out_dir)
    tmp = out.with_name(f"{out.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if base_dir is not None:
        patterns = shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json")
        shutil.copytree(base_dir, tmp, ignore=patterns)
    else:
        tmp.mkdir(parents=True)
    _write_shards(weights, tmp, dtype, max_shard_bytes)
    if config is not None:
        (tmp / "config.json").write_text(json.dumps(dict(config), indent=2))
    if out.exists():
        if keep_existing:
            shutil.rmtree(tmp)
            return out
        shutil.rmtree(out)
    try:
        tmp.rename(out)
    except OSError:  # another writer renamed its copy in between
        if not (keep_existing and out.is_dir()):
            raise
        shutil.rmtree(tmp)
    return out


def _write_shards(
    weights: Iterable[tuple[str, torch.Tensor]], out: Path, dtype: torch.dtype | None, max_shard_bytes: int
) -> None:
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    size, index, files = 0, {}, []

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(files):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, name))
            files.append(name)
            shard, size = {}, 0

    for name, tensor in weights:
        t = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous().clone()
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= max_shard_bytes:
            flush()
    flush()
    if len(files) == 1:  # the HF convention for an unsharded model
        (out / files[0]).rename(out / "model.safetensors")
    elif files:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": index}, indent=2)
        )
