"""Low-rank adapters (LoRA) on the Megatron model, and their full tensors in and out (issue #35).

An adapter adds ``(alpha / r) * B(A(x))`` to the output of one base linear layer (``linear_qkv``,
``linear_proj``, ``linear_fc1``, ``linear_fc2``; on an MoE model the experts' ``linear_fc1/fc2``).
A and B are mcore ``ColumnParallelLinear`` / ``RowParallelLinear`` so the tensor-parallel
communication and its gradients are mcore's own (Megatron-Bridge's layout,
``docs/research/lora.md`` section 2):

=============================  ===================================  ===================================
base (mcore class)             A per TP rank                         B per TP rank
=============================  ===================================  ===================================
linear_qkv, linear_fc1         Column(in->r, gather_output) [r/tp,in]  Column(r->out) [out/tp, r]
(ColumnParallel)                                                      rows in the base shard's layout
linear_proj, linear_fc2        Row(in->r, input_is_parallel)          Column(r->out, gather_output)
(RowParallel)                  [r, in/tp], r output all-reduced       [out/tp, r]
=============================  ===================================  ===================================

One A per fused layer (q/k/v share it, gate/up share it): a PEFT adapter exports losslessly from it
(A copied to q/k/v and gate/up, B split with the base's own qkv / glu tables of ``convert``).

Sequence parallelism: a column base gathers its sequence-sharded input itself, so A (built with the
base's config) does too; B then runs without SP on the full sequence. A row base reduce-scatters its
output over the sequence; the adapter runs without SP (all-reduce) and scatters its full output
along the sequence the same way. Experts (``is_expert``): the dispatcher does the communication;
their adapters are plain per-expert linears, supported with expert-TP 1 only.

Every adapter sits next to its base as a sibling module ``<base>_lora`` (so the base keeps its
parameter names and mcore's sharded state dict of the base is untouched) and is called from a
forward hook on the base. Base parameters are frozen (``requires_grad=False``): DDP, the
(distributed) optimizer and its state hold the adapters only.

Initialisation: A Kaiming-uniform (PEFT's default) drawn for the *full* tensor from a generator
seeded by ``(seed, global layer, module, expert)`` and then sliced, so every layout holds the same
adapters; B zero, so step 0 equals the base model exactly.

The pure exporters (one gather, then plain tensors):
  * :func:`adapter_state` -> ``{PEFT name: full CPU tensor}`` (``base_model.model.model.layers.L...``);
  * :func:`peft_adapter_config` -> ``adapter_config.json`` fields;
  * :func:`merged_to_hf` -> an HF stream's ``to_hf`` that folds ``W + (alpha/r) B A`` into the base
    (``model.lora.sync: merged`` and ``--export-hf-merged``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_acrl.config import Config
from megatron_acrl.config.model import LoraConfig
from megatron_acrl.megatron import convert
from megatron_acrl.megatron.hf_io import ParamLayout
from megatron_acrl.megatron.model import unwrap

__all__ = [
    "LoraAdapter",
    "adapter_state",
    "apply_lora",
    "base_reference",
    "full_adapters",
    "is_lora_param",
    "load_adapter_state",
    "merged_to_hf",
    "peft_adapter_config",
    "write_peft_dir",
]

SUFFIX = "_lora"
"""An adapter's module name: ``<base name>_lora`` next to its base (``linear_qkv_lora``)."""

_COLUMN = ("linear_qkv", "linear_fc1")
_ROW = ("linear_proj", "linear_fc2")


def is_lora_param(name: str) -> bool:
    """Whether the parameter ``name`` (``named_parameters()``) belongs to an adapter."""
    return f"{SUFFIX}." in name


class LoraAdapter(MegatronModule):
    """``x -> (alpha / r) * B(A(dropout(x)))`` for one base linear layer (see the module doc).

    Args:
        base: the mcore Column/RowParallelLinear it adapts (shapes, TP group, expert flag).
        target: ``linear_qkv``, ``linear_proj``, ``linear_fc1`` or ``linear_fc2``.
        config: the base's ``TransformerConfig``.
        lora: rank, alpha, dropout.
    Input ``[s(/tp under SP), b, in(/tp for a row base)]``; output shaped like the base's output.
    """

    def __init__(self, base: torch.nn.Module, target: str, config: TransformerConfig, lora: LoraConfig):
        super().__init__(config=config)
        self.target, self.rank = target, lora.rank
        self.scale = lora.alpha / lora.rank
        self.column = target in _COLUMN
        self.glu = target == "linear_fc1" and config.gated_linear_unit
        self.is_expert = bool(getattr(base, "is_expert", False))
        group = base.tp_group
        tp = group.size()
        if self.is_expert and tp > 1:
            raise NotImplementedError(
                "LoRA on MoE experts needs expert tensor parallel size 1 (here "
                f"{tp}); use parallel.tp=1 or drop linear_fc1/linear_fc2 from model.lora.target_modules"
            )
        if lora.rank % tp:
            raise ValueError(f"model.lora.rank={lora.rank} must be divisible by the TP size {tp}")
        # the adapter's own comms: SP only where the base's input is sequence-sharded (A of a column base)
        no_sp = copy.copy(config)
        no_sp.sequence_parallel = False
        self.sequence_parallel = bool(config.sequence_parallel) and tp > 1 and not self.is_expert
        common = dict(bias=False, init_method=torch.nn.init.zeros_, is_expert=self.is_expert, tp_group=group)
        d_in, d_out = base.input_size, base.output_size
        if self.column:
            self.lora_A = ColumnParallelLinear(
                d_in, lora.rank, config=config, gather_output=True, skip_bias_add=True, **common
            )
            self.lora_B = ColumnParallelLinear(
                lora.rank, d_out, config=no_sp, gather_output=False, skip_bias_add=True, **common
            )
        else:
            self.lora_A = RowParallelLinear(
                d_in, lora.rank, config=no_sp, input_is_parallel=True, skip_bias_add=True, **common
            )
            self.lora_B = ColumnParallelLinear(
                lora.rank, d_out, config=no_sp, gather_output=not self.is_expert, skip_bias_add=True, **common
            )
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else None
        self.tp_group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution, shaped like the base's output."""
        if self.dropout is not None:
            x = self.dropout(x)
        z, _ = self.lora_A(x)
        y, _ = self.lora_B(z)
        if not self.column and self.sequence_parallel:  # like the base's reduce-scatter over the sequence
            y = scatter_to_sequence_parallel_region(y, group=self.tp_group)
        return y * self.scale

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """mcore's TP-sharded tensors; a GLU B is ``[gate_r; up_r]`` per rank like the base's
        ``linear_fc1``, so it gets the base's swiglu factory (checkpoints reshard over TP)."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        key = f"{prefix}lora_B.weight"
        if self.glu and key in out:
            single = (metadata or {}).get("singleton_local_shards", False)
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, single)
        return out


# --------------------------------------------------------------------------------------------
# Building: attach adapters, freeze the base
# --------------------------------------------------------------------------------------------


def _targets(gpt: torch.nn.Module, lora: LoraConfig) -> Iterator[tuple[str, torch.nn.Module, str]]:
    """``(module path, parent, target)`` of every base linear ``lora.target_modules`` names."""
    # in a fixed order (not a set's, which differs between processes): every rank of a TP group
    # must attach, and later gather, its adapters in the same order
    wanted = [t for t in _COLUMN + _ROW if t in lora.target_modules]
    for path, module in list(gpt.named_modules()):
        for target in wanted:
            child = getattr(module, target, None)
            if isinstance(child, ColumnParallelLinear | RowParallelLinear):
                if ".shared_experts" in f".{path}":
                    continue  # the shared expert has no PEFT/SGLang name (Megatron-only semantics)
                yield (f"{path}.{target}" if path else target), module, target


def _hook(adapter: LoraAdapter) -> Callable:
    def add_adapter(_module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + adapter(x).to(out.dtype), bias

    return add_adapter


def apply_lora(
    chunks: list[torch.nn.Module],
    cfg: Config,
    config: TransformerConfig,
    pg: ProcessGroupCollection,
    layer_offsets: list[int],
) -> int:
    """Attach adapters to this rank's model chunks (in place), freeze every base parameter and
    initialise the adapters layout-independently; returns the number of adapters attached.

    ``layer_offsets[i]``: the global index of chunk i's first layer (PP / VPP). Raises
    NotImplementedError on Transformer-Engine layers (their fused LayerNorm+linear would need the
    LayerNorm output), and ValueError when the targets name no layer of this model.
    """
    lora = cfg.model.lora
    assert lora is not None
    count = 0
    for chunk, offset in zip(chunks, layer_offsets, strict=True):
        gpt = unwrap(chunk)
        for p in gpt.parameters():
            p.requires_grad_(False)
        for path, parent, target in _targets(gpt, lora):
            base = getattr(parent, target)
            if type(base).__module__.startswith("megatron.core.extensions"):
                raise NotImplementedError(
                    "LoRA adapters need Megatron's local layer specs (Transformer-Engine layers fuse "
                    "the LayerNorm into linear_qkv/linear_fc1)"
                )
            adapter = LoraAdapter(base, target, getattr(base, "config", config), lora)
            adapter.to(dtype=base.weight.dtype)
            parent.add_module(target + SUFFIX, adapter)
            base.register_forward_hook(_hook(adapter), with_kwargs=True)
            name = convert.canonical_name(f"{path}.weight", layer_offset=offset)
            eo = pg.ep.rank() * (cfg.model.num_experts // pg.ep.size()) if adapter.is_expert else 0
            _init_adapter(adapter, name, cfg.training.seed, eo)
            count += 1
    return count


@torch.no_grad()
def _init_adapter(adapter: LoraAdapter, local_name: str, seed: int, expert_offset: int) -> None:
    """A: Kaiming-uniform (a=sqrt(5), PEFT's) of the full ``[r, in]`` from a generator keyed by the
    adapter's global name, then this rank's slice; B: zero."""
    name = convert.canonical_name(local_name, expert_offset=expert_offset)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    full_in = adapter.lora_A.input_size
    bound = 1.0 / math.sqrt(full_in)  # kaiming_uniform_(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    full = (torch.rand(adapter.rank, full_in, generator=g, dtype=torch.float64) * 2 - 1) * bound
    w = adapter.lora_A.weight
    tp, rank = adapter.tp_group.size(), adapter.tp_group.rank()
    dim = 0 if adapter.column else 1
    w.copy_(full.chunk(tp, dim=dim)[rank].to(w.dtype))
    adapter.lora_B.weight.zero_()


# --------------------------------------------------------------------------------------------
# Full adapter tensors (gathered), PEFT names, merge
# --------------------------------------------------------------------------------------------


@dataclass
class FullAdapter:
    """One adapter as full tensors in the canonical (TP=1) layout: ``a [r, in]``, ``b [out, r]``
    (rows in the base's canonical row order: fused qkv interleaved per group, glu ``[gate; up]``)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def _local_adapters(model: list[torch.nn.Module], layout: ParamLayout) -> Iterator[tuple[str, LoraAdapter]]:
    """``(canonical base weight name, adapter)`` of every local adapter (global layer and expert)."""
    ep = layout.pg.ep
    expert_offset = ep.rank() * layout.local_experts if layout.num_experts else 0
    for vp_stage, chunk in enumerate(model):
        offset = get_transformer_layer_offset(
            layout.config, vp_stage=vp_stage if layout.virtual_pipeline else None, pp_rank=layout.pg.pp.rank()
        )
        for path, module in unwrap(chunk).named_modules():
            if isinstance(module, LoraAdapter):
                base = path[: -len(SUFFIX)] + ".weight"
                eo = expert_offset if module.is_expert else 0
                yield convert.canonical_name(base, layer_offset=offset, expert_offset=eo), module


def _gather_tp(t: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    if group.size() == 1:
        return [t]
    shards = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(shards, t.contiguous(), group=group)
    return shards


def _full_local(module: LoraAdapter) -> FullAdapter:
    """The full tensors of one local adapter (all-gather over its TP group: every rank of it calls)."""
    a_shards = _gather_tp(module.lora_A.weight.detach(), module.tp_group)
    b_shards = _gather_tp(module.lora_B.weight.detach(), module.tp_group)
    a = torch.cat(a_shards, dim=0 if module.column else 1)
    b = convert.tp_merge("linear_fc1.weight" if module.glu else "lora_B.weight", b_shards, 0)
    return FullAdapter(a.cpu(), b.cpu(), module.scale)


def full_adapters(
    model: list[torch.nn.Module], layout: ParamLayout, *, dst: int | None = None
) -> dict[str, FullAdapter]:
    """Every adapter of the model as :class:`FullAdapter`, keyed by its canonical base weight name.

    Collective over the whole world: TP shards are all-gathered, then every pipeline stage's and EP
    rank's adapters collected on global rank ``dst`` (``None``: on every rank). Other ranks get {}.
    """
    local = {name: _full_local(m) for name, m in _local_adapters(model, layout)}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    pg = layout.pg
    # one copy per adapter crosses the world: from the TP-0 / DP-0 rank of its replica
    dense_src = pg.tp.rank() == 0 and pg.dp.rank() == 0
    expert_src = layout.num_experts and pg.expt_tp.rank() == 0 and pg.expt_dp.rank() == 0
    names = [n for n in local if (expert_src if ".local_experts." in n else dense_src)]
    mine = {n: local[n] for n in names}
    if dst is None:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    else:
        parts = [None] * dist.get_world_size() if dist.get_rank() == dst else None
        dist.gather_object(mine, parts, dst=dst)
        if parts is None:
            return {}
    out: dict[str, FullAdapter] = {}
    for part in parts:
        out.update(part)
    return dict(sorted(out.items(), key=lambda kv: _sort_key(kv[0])))


def _sort_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _peft_name(hf_weight_name: str, which: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``base_model.model.model.layers.0.self_attn
    .q_proj.lora_A.weight`` (PEFT's saved key: no adapter name)."""
    return "base_model.model." + hf_weight_name[: -len(".weight")] + f".lora_{which}.weight"


def peft_tensors(adapters: Mapping[str, FullAdapter], info: convert.ArchInfo) -> dict[str, torch.Tensor]:
    """``{PEFT name: tensor}`` of full adapters: B split by the base's qkv / glu rule, A copied."""
    out: dict[str, torch.Tensor] = {}
    for name, ad in adapters.items():
        for hf_name, b_part in convert.megatron_to_hf(name, ad.b, info):
            out[_peft_name(hf_name, "A")] = ad.a.clone()
            out[_peft_name(hf_name, "B")] = b_part.contiguous().clone()
    return out


def adapter_state(
    model: list[torch.nn.Module], layout: ParamLayout, info: convert.ArchInfo, *, dst: int | None = 0
) -> dict[str, torch.Tensor]:
    """The model's adapters as ``{PEFT name: full CPU tensor}`` on global rank ``dst`` (``None``:
    every rank; {} elsewhere); every rank calls it (collective).

    Names ``base_model.model.model.layers.{L}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight`` and
    ``...mlp.{gate,up,down}_proj.lora_{A,B}.weight`` (experts ``...mlp.experts.{E}.gate_proj...``);
    A ``[r, in]``, B ``[out, r]``, in the model's dtype. The scale is ``lora_alpha / r`` of
    :func:`peft_adapter_config`.
    """
    return peft_tensors(full_adapters(model, layout, dst=dst), info)


def peft_adapter_config(cfg: Config, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """``adapter_config.json`` of the run's adapters (:meth:`LoraConfig.peft_config`; what SGLang
    reads: ``r``, ``lora_alpha``, ``target_modules``, ``use_dora``)."""
    lora = cfg.model.lora
    if lora is None:
        raise ValueError("model.lora is null: there are no adapters to describe")
    return lora.peft_config(base_model_name_or_path or cfg.model.hf_path or "")


def merged_to_hf(
    to_hf: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]],
    adapters: Mapping[str, FullAdapter],
) -> Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """``to_hf`` of an HF stream with every adapted weight merged: ``W + (alpha/r) B @ A``, computed
    in fp32 on the full canonical tensor and cast back to W's dtype (meta tensors pass through)."""

    def merged(name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        ad = adapters.get(name)
        if ad is not None and full.device.type != "meta":
            delta = (ad.b.float() @ ad.a.float()) * ad.scale
            full = (full.float() + delta.to(full.device)).to(full.dtype)
        return to_hf(name, full)

    return merged


# --------------------------------------------------------------------------------------------
# Loading adapters from PEFT tensors (tests, and a PEFT directory as the starting adapter)
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def load_adapter_state(
    model: list[torch.nn.Module],
    layout: ParamLayout,
    info: convert.ArchInfo,
    state: Mapping[str, torch.Tensor],
) -> None:
    """Copy full PEFT adapter tensors (:func:`adapter_state`'s names) into this rank's adapter
    shards. A fused layer has one A: q/k/v (gate/up) A must be equal (ValueError otherwise)."""
    for name, module in _local_adapters(model, layout):
        hf_names = convert.hf_sources(name, info)
        a_parts = [state[_peft_name(h, "A")] for h in hf_names]
        if any(not torch.equal(a_parts[0], p) for p in a_parts[1:]):
            raise ValueError(f"{hf_names}: a fused {name} adapter needs one lora_A shared by its parts")
        b_full = convert.hf_to_megatron(name, lambda h: state[_peft_name(h, "B")], info)
        tp, rank = module.tp_group.size(), module.tp_group.rank()
        a = a_parts[0].chunk(tp, dim=0 if module.column else 1)[rank]
        b = convert.tp_shard("linear_fc1.weight" if module.glu else "b", b_full, tp, rank, 0)
        for param, value in ((module.lora_A.weight, a), (module.lora_B.weight, b)):
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{name}: adapter shape {tuple(value.shape)}, model {tuple(param.shape)}")
            param.copy_(value)


# --------------------------------------------------------------------------------------------
# The PEFT directory and the base's reference
# --------------------------------------------------------------------------------------------


def write_peft_dir(
    state: Mapping[str, torch.Tensor], config: Mapping[str, Any], out_dir: str | os.PathLike
) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (fp32, as PEFT saves) into
    ``out_dir``, atomically (a temporary directory renamed into place).

    Refuses MoE expert adapters (ValueError): transformers 5.19 holds a Qwen2-MoE / Qwen3-MoE
    layer's experts as two fused 3-D parameters (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
    ``mlp.experts.down_proj``), with no per-expert ``experts.{E}.gate_proj`` module, and PEFT 0.21
    turns ``gate_proj/up_proj/down_proj`` targets into its own parameter adapters on those (one
    ``lora_A [E*r, in]`` / ``lora_B [out, E*r]`` per fused parameter, nested ``base_layer`` keys).
    Per-expert keys would load as unexpected keys, with only a warning, and leave the experts'
    adapters at zero: the model PEFT builds would silently differ from the trainer's."""
    from safetensors.torch import save_file

    experts = [k for k in state if ".mlp.experts." in k]
    if experts:
        raise ValueError(
            f"model.lora.target_modules: {len(experts)} adapter tensors sit on MoE experts (e.g. "
            f"{experts[0]}), which PEFT + transformers cannot load per expert (transformers fuses a "
            "layer's experts into 3-D parameters); export the merged model (--export-hf-merged) or "
            "leave linear_fc1/linear_fc2 out of model.lora.target_modules on an MoE model"
        )
    out = Path(out_dir)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(dict(config), indent=2))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


_SAMPLES, _SAMPLE_BYTES = 64, 1 << 16


def base_reference(source: Any) -> dict[str, Any]:
    """What a LoRA checkpoint records of its base: the path and a fingerprint of its weights.

    The fingerprint is a SHA-256 over each ``*.safetensors`` file's name, size, header (every tensor's
    name, dtype, shape and offsets) and 64 evenly spaced 64 KiB samples of its data: any other model,
    or the same one retrained, gives another value, at the cost of reading a few MiB (not the whole
    model). A mapping source (tests) hashes its tensors in full.
    """
    h = hashlib.sha256()
    if isinstance(source, Mapping):
        for k in sorted(source):
            t = source[k].detach().cpu().contiguous()
            h.update(k.encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return {"path": None, "sha256": h.hexdigest()}
    path = Path(source)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    for f in files:
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(n))
            for i in range(_SAMPLES):
                fh.seek(8 + n + (size - 8 - n) * i // _SAMPLES)
                h.update(fh.read(_SAMPLE_BYTES))
    return {"path": str(path), "sha256": h.hexdigest()}
