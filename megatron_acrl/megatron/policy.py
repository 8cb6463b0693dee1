"""The Megatron-Core trainer: forward-only log-probs, one optimizer step, weights in and out.

Process groups are read once (``ProcessGroupCollection.use_mpu_process_groups()``) after
:func:`initialize_parallel` and passed explicitly to the model, DDP, the optimizer, the schedule and
our own collectives. Every rank holds the whole rollout batch (the driver broadcasts it); each
data-parallel rank trains on its contiguous slice of sequences, so the global loss denominators are
known locally without a collective.

Rank roles:
  * the last pipeline stage computes log-probs and the loss (``loss_adapter``);
  * metrics and forward-only log-probs are reduced over DP on the last stage, then broadcast over the
    pipeline group so every rank (rank 0 drives the loop and sits on the first stage) has them;
  * the ACRL controller is updated on the last stage from DP-all-reduced statistics and its state is
    broadcast over the pipeline group: all ranks agree.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_acrl.config import Config, ConfigError, ParallelConfig
from megatron_acrl.megatron import cpu_compat
from megatron_acrl.megatron.model import (
    build_model_chunks,
    padded_vocab_size,
    transformer_config,
    unwrap,
)

cpu_compat.apply()

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.dist_checkpointing.serialization import (  # noqa: E402
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (  # noqa: E402
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402

from megatron_acrl.correction import (  # noqa: E402
    AcrlController,
    MismatchTensors,
    acrl_discrepancy_stats,
    combine_partials,
    finalize_metrics,
)
from megatron_acrl.megatron import convert  # noqa: E402
from megatron_acrl.megatron.collectives import all_reduce_partials  # noqa: E402
from megatron_acrl.megatron.loss_adapter import LossAdapter, LossFn  # noqa: E402
from megatron_acrl.megatron.routing_replay import (  # noqa: E402
    RoutingReplay,
    routing_mismatch_metrics,
    routing_mismatch_sums,
)

__all__ = ["MegatronModel", "Policy", "initialize_parallel", "resolve_step_dir", "save_step_atomically"]

TRAIN_KEYS = ("tokens", "loss_mask", "old_logprobs", "rollout_logprobs", "advantages")


def initialize_parallel(parallel: ParallelConfig, seed: int) -> None:
    """Create Megatron's process groups for ``parallel`` and seed the model-parallel RNG.

    ``torch.distributed`` must already be initialised (gloo on CPU, nccl on GPU). Call
    ``parallel_state.destroy_model_parallel()`` before re-initialising with another layout.
    """
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        expert_model_parallel_size=parallel.ep,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


@dataclass
class _Entry:
    """One local parameter and how to turn it into full canonical tensor(s)."""

    param: torch.nn.Parameter
    local_name: str  # canonical name with layer offset applied, local expert index
    is_expert: bool
    names: list[str]  # canonical names of the full tensors it yields (several for EP)


class MegatronModel:
    """A Megatron-Core GPT model trained with its own optimizer: the shared half of :class:`Policy`
    (the policy) and ``megatron_acrl.megatron.critic.Critic`` (the PPO value model).

    Holds the DDP-wrapped chunks of this rank, the Megatron optimizer and LR schedule, and the
    pieces both models drive the same way: micro-batching of this DP rank's slice, the pipeline
    schedule, the forward-only gather (last stage -> every rank), one optimizer step with reduced
    metrics, HF weights in and out (streamed, TP/EP shards gathered) and per-rank checkpoint files.

    Subclasses customise the model through :meth:`_build_chunks` and the HF mapping of their own
    parameters through :meth:`_to_hf` / :meth:`_from_hf`.

    Args:
        cfg: the run configuration.
        pg_collection: process groups; None reads Megatron's (``initialize_parallel`` first).
        total_steps: optimizer steps of the LR schedule (default ``num_steps * ppo_epochs *
            num_minibatches``).
    """

    routing: RoutingReplay | None = None
    """MoE routing replay / observation of this model's routers (the policy's; None elsewhere)."""

    def __init__(
        self,
        cfg: Config,
        *,
        pg_collection: ProcessGroupCollection | None = None,
        total_steps: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.pg = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        pg = self.pg
        self.tp_size, self.pp_size, self.dp_size = pg.tp.size(), pg.pp.size(), pg.dp.size()
        self.pp_rank, self.dp_rank = pg.pp.rank(), pg.dp.rank()
        self.is_last_stage = self.pp_rank == self.pp_size - 1
        self.last_stage_rank = dist.get_global_rank(pg.pp, self.pp_size - 1)
        self.info = convert.ArchInfo.from_model_config(cfg.model)
        self.padded_vocab = padded_vocab_size(cfg.model.vocab_size, self.tp_size)

        self.config = transformer_config(cfg.model, cfg.parallel, recompute=cfg.training.activation_recompute)
        self.ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.parallel.distributed_optimizer,
            # 1/dp pre-scaling (not an AVG collective, which gloo lacks); the adapter undoes it.
            average_in_collective=False,
        )
        chunks = self._build_chunks()
        self.model = [
            DistributedDataParallel(
                self.config, self.ddp_config, c, disable_bucketing=i > 0, pg_collection=pg
            )
            for i, c in enumerate(chunks)
        ]
        self.config.no_sync_func = (
            [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        )
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = None

        t = cfg.training
        self.opt_config = OptimizerConfig(
            optimizer="adam",  # AdamW; the distributed optimizer supports only Adam
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            adam_eps=t.adam_eps,
            clip_grad=t.grad_clip,
            bf16=self.config.bf16,
            params_dtype=self.config.params_dtype,
            use_distributed_optimizer=cfg.parallel.distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(
            self.opt_config, self.model, use_gloo_process_groups=False, pg_collection=pg
        )
        a = cfg.algorithm
        steps = total_steps or max(1, t.num_steps * a.ppo_epochs * a.num_minibatches)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if t.lr_warmup_steps else t.lr,
            max_lr=t.lr,
            min_lr=t.min_lr,
            lr_warmup_steps=t.lr_warmup_steps,
            lr_decay_steps=max(steps, t.lr_warmup_steps + 1),
            lr_decay_style="cosine",
            start_wd=t.weight_decay,
            end_wd=t.weight_decay,
            wd_incr_steps=max(steps, 1),
            wd_incr_style="constant",
        )
        self.step = 0

    def _build_chunks(self) -> list[torch.nn.Module]:
        """This rank's (not yet DDP-wrapped) model chunks; subclasses may change their heads."""
        return build_model_chunks(self.cfg.model, self.cfg.parallel, self.config, self.pg)

    # ----------------------------------------------------------------------------------------
    # Batches and the schedule
    # ----------------------------------------------------------------------------------------

    def _seq_multiple(self) -> int:
        # Sequence parallelism scatters the sequence over TP ranks.
        return self.tp_size if self.config.sequence_parallel else 1

    def _micro_batches(self, batch: Mapping[str, torch.Tensor], keys: tuple[str, ...]) -> list[dict]:
        """This DP rank's contiguous slice of ``batch``, cut into micro-batches (right-padded to a
        sequence length Megatron accepts)."""
        n, length = batch["tokens"].shape
        mbs = self.cfg.training.micro_batch_size
        if n % (self.dp_size * mbs):
            raise ValueError(
                f"batch of {n} sequences cannot be split into dp={self.dp_size} x micro_batch_size={mbs} "
                f"micro-batches; use a multiple of {self.dp_size * mbs}"
            )
        per_rank = n // self.dp_size
        lo = self.dp_rank * per_rank
        mult = self._seq_multiple()
        padded = -(-length // mult) * mult
        micro = []
        for start in range(lo, lo + per_rank, mbs):
            mb = {}
            for k in keys:
                if k not in batch:
                    continue
                v = batch[k][start : start + mbs]
                if padded != length and v.dim() > 2:  # [b, L, layers, k] routing: -1 = unknown
                    v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, padded - length), value=-1)
                elif padded != length:  # pad tokens/masks/log-probs with zeros: masked, never scored
                    v = torch.nn.functional.pad(v, (0, padded - length))
                mb[k] = v.contiguous()
            mb["position_ids"] = (
                torch.arange(padded).unsqueeze(0).expand(mb["tokens"].shape[0], -1).contiguous()
            )
            micro.append(mb)
        return micro

    def _run_schedule(
        self,
        model: list[torch.nn.Module],
        micro: list[dict],
        loss_func_for,  # noqa: ANN001 - micro-batch -> Megatron loss_func
        forward_only: bool,
        collect: bool,
    ) -> list[Any]:
        # bf16: keep the logits in bf16 (Float16Module would otherwise upcast the whole
        # [b, s, V/tp] tensor); the fused log-prob casts chunk by chunk.
        extra = {"fp32_output": False} if self.config.bf16 else {}

        routing = self.routing if model is self.model else None  # MoE routing replay (policy only)

        def forward_step(data_iterator: Iterator[dict], chunk: torch.nn.Module):
            mb = next(data_iterator)
            if routing is not None:
                routing.before_forward(chunk, mb)
            out = chunk(mb["tokens"], mb["position_ids"], None, **extra)
            if routing is not None:  # a recompute of this forward pops the same indices (FIFO)
                routing.after_forward(chunk)
            return out, loss_func_for(mb)

        seq_len = micro[0]["tokens"].shape[1]
        iters = [iter(micro) for _ in model]  # every virtual stage walks the same micro-batches
        kwargs: dict[str, Any] = {}
        if self.pp_size > 1:
            kwargs["p2p_communicator"] = P2PCommunicator(pp_group=self.pg.pp, config=self.config)
        return get_forward_backward_func(self.pp_size, self.cfg.parallel.vpp)(
            forward_step_func=forward_step,
            data_iterator=iters if len(model) > 1 else iters[0],
            model=model,
            num_microbatches=len(micro),
            seq_length=seq_len,
            micro_batch_size=micro[0]["tokens"].shape[0],
            forward_only=forward_only,
            collect_non_loss_data=collect,
            pg_collection=self.pg,
            **kwargs,
        )

    def _broadcast_from_last_stage(self, obj: Any) -> Any:
        if self.pp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.last_stage_rank, group=self.pg.pp)
        return box[0]

    @torch.no_grad()
    def _forward_only(
        self,
        model: list[torch.nn.Module],
        batch: Mapping[str, torch.Tensor],
        collect_for,  # noqa: ANN001 - micro-batch -> collect function returning {key: [b, T]}
        keys: list[str],
    ) -> dict[str, torch.Tensor]:
        """Run ``model`` forward-only over ``batch["tokens"] [N, L]`` and return ``{key: [N, L]}`` on
        every rank: micro-batch outputs are concatenated and cut back to L on the last stage,
        all-gathered over DP (ranks hold contiguous slices, so rank order is batch order), then
        broadcast over the pipeline group."""
        for chunk in model:
            chunk.eval()
        micro = self._micro_batches(batch, ("tokens", "replay_experts"))
        out = self._run_schedule(model, micro, collect_for, True, True)
        length = batch["tokens"].shape[1]
        result: dict[str, torch.Tensor] | None = None
        if self.is_last_stage:
            result = {}
            for k in keys:
                v = torch.cat([o[k] for o in out], 0)[:, :length].contiguous()
                parts = [torch.empty_like(v) for _ in range(self.dp_size)]
                dist.all_gather(parts, v, group=self.pg.dp)
                result[k] = torch.cat(parts, 0)
        result = self._broadcast_from_last_stage(result)
        for chunk in self.model:
            chunk.train()
        return result

    def _optimizer_step(self, micro: list[dict], loss_func_for) -> dict[str, float]:  # noqa: ANN001
        """Forward/backward over ``micro`` under the schedule, then one optimizer and LR step.

        Returns the loss function's partial metrics reduced over micro-batches and DP (same on every
        rank), plus ``grad_norm``, ``lr`` (the rate this step used) and ``update_successful``.
        """
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._run_schedule(self.model, micro, loss_func_for, False, False)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step uses
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self.step += 1

        metrics: dict[str, float] | None = None
        if self.is_last_stage:
            partials = all_reduce_partials(combine_partials(out), group=self.pg.dp)
            metrics = finalize_metrics(partials)
        metrics = dict(self._broadcast_from_last_stage(metrics))
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = lr
        metrics["update_successful"] = float(bool(ok))
        return metrics

    # ----------------------------------------------------------------------------------------
    # Weights: HF export (streamed) and load
    # ----------------------------------------------------------------------------------------

    def _to_hf(self, name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """HF ``(name, tensor)`` pairs of one full canonical Megatron tensor."""
        return convert.megatron_to_hf(name, full, self.info)

    def _from_hf(self, name: str, get) -> torch.Tensor:  # noqa: ANN001 - get(hf_name) -> tensor
        """The full canonical Megatron tensor ``name`` built from HF tensors."""
        return convert.hf_to_megatron(name, get, self.info, padded_vocab=self.padded_vocab)

    def _entries(self, model: list[torch.nn.Module]) -> list[_Entry]:
        """Local parameters with their canonical names (the same order on every rank of a stage)."""
        ep_size = self.pg.ep.size()
        n_local_experts = (self.cfg.model.num_experts // ep_size) if self.cfg.model.num_experts else 0
        entries = []
        for vp_stage, chunk in enumerate(model):
            offset = get_transformer_layer_offset(
                self.config, vp_stage=vp_stage if self.cfg.parallel.vpp else None, pp_rank=self.pp_rank
            )
            gpt = unwrap(chunk)
            for name, param in gpt.named_parameters():
                local = convert.canonical_name(name, layer_offset=offset)
                if local == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
                    continue  # the tied copy on the last stage; exported from the embedding
                is_expert = not getattr(param, "allreduce", True)
                if is_expert:
                    names = [
                        convert.canonical_name(local, expert_offset=r * n_local_experts)
                        for r in range(ep_size)
                    ]
                else:
                    names = [local]
                entries.append(_Entry(param, local, is_expert, names))
        return entries

    def _gather_full(self, e: _Entry) -> list[torch.Tensor]:
        """Full tensors of one entry (collective over TP, expert-TP and EP groups of this stage)."""
        t = e.param.detach()
        if getattr(e.param, "tensor_model_parallel", False):
            group = self.pg.expt_tp if e.is_expert else self.pg.tp
            if group.size() > 1:
                shards = [torch.empty_like(t) for _ in range(group.size())]
                dist.all_gather(shards, t.contiguous(), group=group)
                t = convert.tp_merge(e.local_name, shards, e.param.partition_dim)
        if e.is_expert and self.pg.ep.size() > 1:
            parts = [torch.empty_like(t) for _ in range(self.pg.ep.size())]
            dist.all_gather(parts, t.contiguous(), group=self.pg.ep)
            return parts
        return [t]

    def hf_weights(self, all_stages: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``(hf_name, full tensor)`` pairs, one tensor at a time, gathered from TP/EP shards.

        Every rank must iterate (the gathers are collectives). With ``all_stages=False`` a rank yields
        the tensors of its own pipeline stage (what per-stage weight sync needs: the (DP0, TP0) rank of
        each stage sends); with ``all_stages=True`` every rank yields the whole model, stage by stage
        (tensors are broadcast over the pipeline group). Tensors keep the model's dtype and must be
        treated as read-only.
        """
        entries = self._entries(self.model)
        if not all_stages or self.pp_size == 1:
            for e in entries:
                for name, full in zip(e.names, self._gather_full(e), strict=True):
                    yield from self._to_hf(name, full)
            return
        # Shapes/dtypes of every stage's full tensors, so receivers can allocate.
        plan = []
        for e in entries:
            shape = list(e.param.shape)
            if getattr(e.param, "tensor_model_parallel", False):
                group = self.pg.expt_tp if e.is_expert else self.pg.tp
                shape[e.param.partition_dim] *= group.size()
            plan.append((e.names, shape, str(e.param.dtype).replace("torch.", "")))
        plans: list[Any] = [None] * self.pp_size
        dist.all_gather_object(plans, plan, group=self.pg.pp)
        for stage in range(self.pp_size):
            src = dist.get_global_rank(self.pg.pp, stage)
            mine = stage == self.pp_rank
            for i, (names, shape, dtype) in enumerate(plans[stage]):
                fulls = (
                    self._gather_full(entries[i])
                    if mine
                    else [torch.empty(shape, dtype=getattr(torch, dtype)) for _ in names]
                )
                for name, full in zip(names, fulls, strict=True):
                    full = full.contiguous()
                    dist.broadcast(full, src=src, group=self.pg.pp)
                    yield from self._to_hf(name, full)

    def load_hf(self, source: str | os.PathLike | Mapping[str, torch.Tensor]) -> None:
        """Load HF weights (a safetensors file/directory or a name -> tensor mapping) into the model.
        Every rank reads only the tensors its shards need."""
        get, close = _hf_getter(source)
        try:
            self._load_into(self.model, get)
        finally:
            close()
        self.optimizer.reload_model_params()  # refresh fp32 main params (bf16 / distributed opt.)

    @torch.no_grad()
    def _load_into(self, model: list[torch.nn.Module], get) -> None:  # noqa: ANN001
        ep_size, ep_rank = self.pg.ep.size(), self.pg.ep.rank()
        n_local_experts = (self.cfg.model.num_experts // ep_size) if self.cfg.model.num_experts else 0
        for vp_stage, chunk in enumerate(model):
            offset = get_transformer_layer_offset(
                self.config, vp_stage=vp_stage if self.cfg.parallel.vpp else None, pp_rank=self.pp_rank
            )
            for name, param in unwrap(chunk).named_parameters():
                is_expert = not getattr(param, "allreduce", True)
                canon = convert.canonical_name(
                    name, layer_offset=offset, expert_offset=ep_rank * n_local_experts if is_expert else 0
                )
                full = self._from_hf(canon, get)
                if getattr(param, "tensor_model_parallel", False):
                    group = self.pg.expt_tp if is_expert else self.pg.tp
                    full = convert.tp_shard(canon, full, group.size(), group.rank(), param.partition_dim)
                if tuple(full.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{canon}: HF weights give shape {tuple(full.shape)}, "
                        f"the model has {tuple(param.shape)}"
                    )
                param.copy_(full)

    # ----------------------------------------------------------------------------------------
    # Checkpoints: Megatron distributed checkpoints (torch_dist), reshardable over TP/PP/EP/DP
    # ----------------------------------------------------------------------------------------

    ckpt_kind = "policy"
    """Subdirectory of a step directory holding this model's distributed checkpoint."""

    def _sharded_metadata(self) -> dict[str, Any]:
        """Metadata steering ``sharded_state_dict`` of the model and the optimizer."""
        return {
            # The distributed optimizer's state in the canonical per-parameter layout (gathered
            # over DP on save, sliced on load), so it reshards over TP, PP, EP and DP like the
            # weights. 'dp_reshardable' would be fully parallel but tied to this TP x PP layout.
            "distrib_optim_sharding_type": "fully_reshardable",
            "chained_optim_avoid_prefix": True,
            "singleton_local_shards": False,
            "dp_cp_group": self.pg.dp_cp,
        }

    def sharded_state_dict(self, is_loading: bool = False) -> dict[str, Any]:
        """This rank's training state for ``dist_checkpointing``: ShardedTensors of the model
        chunks (global names and offsets, so any layout can read them) and of the optimizer state;
        the LR schedule, step and :meth:`_checkpoint_meta` are common state (written by rank 0)."""
        meta = self._sharded_metadata()
        # Chunk keys are only containers: tensors are matched by their global ShardedTensor keys
        # (layer numbers with the pipeline offset applied), so VPP <-> no-VPP loads work too.
        model = {f"chunk{i}": self._chunk_sharded_state_dict(c, meta) for i, c in enumerate(self.model)}
        return {
            "model": model,
            "optimizer": self.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=meta),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "acrl_meta": self._checkpoint_meta(),
        }

    def _chunk_sharded_state_dict(self, chunk: torch.nn.Module, meta: dict[str, Any]) -> dict[str, Any]:
        """One model chunk's sharded state dict (subclasses with another head adapt it)."""
        return unwrap(chunk).sharded_state_dict(metadata=meta)

    def _checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be loadable: the tensors' global shapes and dtypes
        (model fields), the optimizer format and the model kind; the layout is informational."""
        m = self.cfg.model
        return {
            "kind": self.ckpt_kind,
            "model": {k: getattr(m, k) for k in _CHECKPOINT_MODEL_FIELDS},
            "distributed_optimizer": self.cfg.parallel.distributed_optimizer,
            # Megatron chains a second optimizer for expert-parallel parameters; the optimizer's
            # common state is one entry per chained optimizer, so the count must not change.
            "optimizers": len(getattr(self.optimizer, "chained_optimizers", [self.optimizer])),
            "layout": self._layout(),
        }

    def save_dist(self, path: str | os.PathLike) -> None:
        """Write this model's distributed checkpoint into ``path`` (all ranks call it).

        ``torch_dist`` backend (``torch.distributed.checkpoint`` files, fsynced); replicated shards
        are spread over the DP ranks (fully parallel save), each shard is written once.
        """
        path = Path(path)
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy(CHECKPOINT_BACKEND), self.pg.dp_cp
        )
        dist_checkpointing.save(self.sharded_state_dict(), str(path), strategy)

    def load_dist(self, path: str | os.PathLike) -> None:
        """Load a distributed checkpoint written by :meth:`save_dist` under any TP/PP/VPP/EP/DP layout.

        Raises ConfigError naming every mismatched model field when the checkpoint belongs to
        another model (before any tensor is read, instead of a shape error deep in the loader).
        """
        path = Path(path)
        self._check_compatible(path)
        strategy = FullyParallelLoadStrategyWrapper(
            get_default_load_sharded_strategy(str(path)), self.pg.dp_cp
        )
        state = dist_checkpointing.load(self.sharded_state_dict(is_loading=True), str(path), strategy)
        for i, chunk in enumerate(self.model):
            missing, unexpected = unwrap(chunk).load_state_dict(state["model"][f"chunk{i}"], strict=False)
            # Only Megatron's (empty, local-spec) ``_extra_state`` entries may be absent.
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise RuntimeError(f"{path}: chunk {i} missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.optimizer.load_state_dict(state["optimizer"])
        # No reload_model_params() here: the bf16 optimizer's load_state_dict has just restored the
        # fp32 main params, and copying the bf16 model params over them would round them to bf16
        # (a resumed bf16 run then drifts from the uninterrupted one); fp32 models have no copy.
        self.scheduler.num_steps = 0  # Megatron's load_state_dict *adds* the saved step count
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])

    def _check_compatible(self, path: Path) -> None:
        if not (path / "metadata.json").exists():
            raise FileNotFoundError(
                f"{path} is not a distributed checkpoint (no metadata.json): the step directory is "
                f"incomplete or has no {self.ckpt_kind} state (a PPO critic needs a checkpoint of a PPO run)"
            )
        saved = dist_checkpointing.load_common_state_dict(str(path)).get("acrl_meta")
        if saved is None:
            raise ConfigError([("training.checkpoint_dir", f"{path} was not written by megatron-acrl")])
        mine = self._checkpoint_meta()
        hint = (
            "set it to the checkpoint's value to resume, or point training.checkpoint_dir at a new "
            "directory (or set training.resume=false) to start fresh"
        )
        errors = [
            (f"model.{k}", f"checkpoint {path} has {saved['model'].get(k)!r}, this run {v!r}; {hint}")
            for k, v in mine["model"].items()
            if saved["model"].get(k) != v
        ]
        if saved["distributed_optimizer"] != mine["distributed_optimizer"]:
            errors.append(
                (
                    "parallel.distributed_optimizer",
                    f"checkpoint {path} has {saved['distributed_optimizer']}, this run "
                    f"{mine['distributed_optimizer']} (optimizer state formats differ); {hint}",
                )
            )
        if saved.get("optimizers", mine["optimizers"]) != mine["optimizers"]:
            errors.append(
                (
                    "parallel.ep",
                    f"checkpoint {path} was written with {saved['optimizers']} chained optimizer(s) "
                    f"(layout {saved['layout']}), this run has {mine['optimizers']}: Megatron gives "
                    "expert parameters their own optimizer only under expert parallelism, so EP=1 and "
                    "EP>1 checkpoints do not exchange optimizer state; keep parallel.ep on the same side "
                    "of 1, or export the weights (--export-hf) and start from them with model.hf_path",
                )
            )
        if saved["kind"] != mine["kind"]:
            errors.append(("", f"{path} holds a {saved['kind']} model, not a {mine['kind']}"))
        if errors:
            raise ConfigError(errors)

    def _load_latest(self, directory: str | os.PathLike, step: int | None) -> bool:
        """Load ``<step dir>/<ckpt_kind>`` of ``step`` or of the one ``latest.json`` names."""
        found = resolve_step_dir(directory, step)
        if found is None:
            return False
        self.load_dist(found / self.ckpt_kind)
        return True

    def _layout(self) -> dict[str, Any]:
        p = self.cfg.parallel
        return {
            "tp": p.tp,
            "pp": p.pp,
            "vpp": p.vpp,
            "ep": p.ep,
            "dp": self.dp_size,
            "distributed_optimizer": p.distributed_optimizer,
            "world": dist.get_world_size(),
        }


class Policy(MegatronModel):
    """Megatron-Core policy (and optional reference model) for RL post-training.

    Args:
        cfg: the run configuration.
        pg_collection: process groups; None reads Megatron's (``initialize_parallel`` first).
        loss_fn: the pure loss (default ``megatron_acrl.losses.rl_loss``).
        total_steps: optimizer steps of the LR schedule (default ``num_steps * ppo_epochs *
            num_minibatches``).
    """

    def __init__(
        self,
        cfg: Config,
        *,
        pg_collection: ProcessGroupCollection | None = None,
        loss_fn: LossFn | None = None,
        total_steps: int | None = None,
    ) -> None:
        super().__init__(cfg, pg_collection=pg_collection, total_steps=total_steps)
        a = cfg.algorithm
        self.ref_model: list[torch.nn.Module] | None = None
        if a.kl_coef > 0:
            ref_config = transformer_config(cfg.model, cfg.parallel)
            self.ref_model = build_model_chunks(cfg.model, cfg.parallel, ref_config, self.pg)
            for chunk in self.ref_model:
                chunk.requires_grad_(False)
            self._copy_policy_to_ref()

        self.adapter = LossAdapter(
            algorithm=a,
            correction=cfg.correction,
            tp_group=self.pg.tp,
            vocab_size=cfg.model.vocab_size,
            temperature=cfg.rollout.temperature,
            chunk_size=cfg.training.logprob_chunk_size,
            norm_len=a.loss_norm_len or cfg.rollout.max_new_tokens,
            loss_fn=loss_fn,
        )
        self.controller = AcrlController(cfg.correction) if cfg.correction.method == "acrl" else None
        self._own_routing: torch.Tensor | None = None  # [N, L, local MoE layers, k], last pi_old pass
        self._applied_routing: torch.Tensor | None = None  # what those routers used (after replay)
        if cfg.model.is_moe:
            self.routing = RoutingReplay(
                self.model, sequence_parallel=self.config.sequence_parallel, tp_group=self.pg.tp
            )

    # ----------------------------------------------------------------------------------------
    # MoE routing replay (R3: the rollout's experts; R2: the pi_old pass's own)
    # ----------------------------------------------------------------------------------------

    def _replay_source(self, batch: Mapping[str, torch.Tensor], training: bool) -> torch.Tensor | None:
        """``[N, L, local MoE layers, k]`` indices to replay in this pass (None: route freely)."""
        mode = self.cfg.model.moe_routing_replay
        if self.routing is None or mode == "off":
            return None
        if mode == "rollout":
            experts = batch.get("routed_experts")
            if experts is None:
                raise KeyError(
                    "model.moe_routing_replay=rollout needs the rollout's routed_experts in the batch "
                    "(SGLang with return_routed_experts, or replayed rollouts recorded with them)"
                )
            if experts.dim() != 4 or experts.shape[2] != self.cfg.model.num_layers:
                raise ValueError(
                    f"routed_experts must be [N, L, num_layers={self.cfg.model.num_layers}, top_k], "
                    f"got {tuple(experts.shape)}"
                )
            return experts[:, :, self.routing.layers]
        if not training:
            return None  # R2: the pi_old pass routes freely and records
        recorded = batch.get("recorded_experts")
        if recorded is None:
            raise KeyError(
                "model.moe_routing_replay=train replays the pi_old pass's routing: put "
                "forward_logprobs(batch)['recorded_experts'] into the train batch"
            )
        return recorded

    def routing_metrics(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Trainer-vs-rollout routing mismatch of the last pi_old pass (all ranks call it).

        Needs ``routed_experts [N, L, layers, k]``, ``old_logprobs``, ``rollout_logprobs`` and
        ``loss_mask`` of the batch :meth:`forward_logprobs` just ran on; {} for dense models or
        batches without routed experts. The trainer's side is its own choice *before* replay.
        Per-layer sums of each stage are summed over the pipeline group (explicitly); within a stage
        every rank already holds the whole batch (:meth:`RoutingReplay.assemble`).
        """
        if self.routing is None or self._own_routing is None or "routed_experts" not in batch:
            return {}
        assert self._applied_routing is not None
        rollout = batch["routed_experts"][:, :, self.routing.layers]
        lps = (batch["old_logprobs"], batch["rollout_logprobs"], batch["loss_mask"])
        n_layers = self.cfg.model.num_layers
        out: dict[str, float] = {}
        # Before replay (the router's own choice), then what the routers actually used.
        for own, suffix in ((self._own_routing, ""), (self._applied_routing, "_applied")):
            sums_local, flips = routing_mismatch_sums(own, rollout, *lps)
            sums = torch.zeros(n_layers, sums_local.shape[1], dtype=torch.float64)
            sums[self.routing.layers] = sums_local
            if self.pp_size > 1:
                dist.all_reduce(sums, group=self.pg.pp)
                dist.all_reduce(flips, group=self.pg.pp)
            m = routing_mismatch_metrics(sums, flips, *lps, range(n_layers))
            if suffix:
                out["routing/disagree_frac_applied"] = m["routing/disagree_frac"]
            else:
                out.update(m)
        return out

    # ----------------------------------------------------------------------------------------
    # Forward-only log-probs (pi_old, reference)
    # ----------------------------------------------------------------------------------------

    def forward_logprobs(
        self, batch: Mapping[str, torch.Tensor], *, reference: bool = False, with_entropy: bool = False
    ) -> dict[str, torch.Tensor]:
        """Per-token log-probs of ``batch["tokens"]`` under the current policy (or the reference model).

        Args:
            batch: at least ``tokens [N, L]`` int64 (the whole rollout batch, on every rank).
            reference: use the frozen reference model (needs ``algorithm.kl_coef > 0``).
            with_entropy: also return token entropies.
        Returns:
            ``{"logprobs": [N, L] float32, "entropy": [N, L] (if asked)}`` on every rank; position 0
            holds 0 (padding positions hold the model's numbers and must be masked by the caller).
            With ``model.moe_routing_replay=train`` (R2) also ``recorded_experts [N, L, this stage's
            MoE layers, k]`` int16: the routing of this pass, which :meth:`train_step` replays.

        MoE: with ``moe_routing_replay=rollout`` (R3) the policy replays ``batch["routed_experts"]``;
        the routers' own choices are observed for :meth:`routing_metrics` (and recorded for R2).
        """
        model = self.model
        if reference:
            if self.ref_model is None:
                raise RuntimeError("no reference model: set algorithm.kl_coef > 0")
            model = self.ref_model
        keys = ["logprobs"] + (["entropy"] if with_entropy else [])
        routing = None if reference else self.routing
        observe = routing is not None and (
            "routed_experts" in batch or self.cfg.model.moe_routing_replay == "train"
        )
        source = None if routing is None else self._replay_source(batch, training=False)
        if source is not None:
            batch = dict(batch, replay_experts=source)
        if routing is not None:
            routing.begin(replay=source is not None, observe=observe)
        try:
            out = self._forward_only(
                model, batch, lambda mb: self.adapter.forward_only_func(mb, with_entropy), keys
            )
        finally:
            observed, applied = routing.end() if routing is not None else (None, None)
        if routing is None:
            return out
        self._own_routing = self._applied_routing = None
        if observe and len(routing):
            n, length = batch["tokens"].shape
            mult = self._seq_multiple()
            shape = dict(
                num_seqs=n,
                seq_len=length,
                padded_len=-(-length // mult) * mult,
                micro_batch_size=self.cfg.training.micro_batch_size,
                dp_group=self.pg.dp,
            )
            self._own_routing = routing.assemble(observed, **shape)
            self._applied_routing = routing.assemble(applied, **shape)
            if self.cfg.model.moe_routing_replay == "train":
                out = dict(out, recorded_experts=self._own_routing)
        return out

    # ----------------------------------------------------------------------------------------
    # ACRL controller
    # ----------------------------------------------------------------------------------------

    def update_controller(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Observe one rollout batch (call once, before its first optimizer step).

        Statistics of this DP rank's sequences are all-reduced (SUM) over DP on the last stage,
        the controller is updated there and its state broadcast over the pipeline group.
        Returns the controller's metrics (empty when the method is not acrl).
        """
        if self.controller is None:
            return {}
        state = None
        if self.is_last_stage:
            n = batch["tokens"].shape[0]
            per_rank = n // self.dp_size
            sl = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
            stats = acrl_discrepancy_stats(
                MismatchTensors(
                    batch["old_logprobs"][sl].float(),
                    batch["rollout_logprobs"][sl].float(),
                    batch["loss_mask"][sl],
                    fused=self.adapter.fused,
                ),
                self.cfg.correction.distance,
            )
            dist.all_reduce(stats, group=self.pg.dp)
            self.controller.update(stats)
            state = self.controller.state_dict()
        state = self._broadcast_from_last_stage(state)
        self.controller.load_state_dict(state)
        return self.controller.metrics()

    # ----------------------------------------------------------------------------------------
    # One optimizer step
    # ----------------------------------------------------------------------------------------

    def train_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on ``batch`` (the minibatch; every rank holds all of it).

        Args:
            batch: ``tokens, loss_mask, old_logprobs, rollout_logprobs, advantages`` (+ optional
                ``ref_logprobs``), all ``[N, L]``.
        Returns:
            Final metrics (same on every rank): the loss function's, plus ``grad_norm``, ``lr``,
            ``update_successful`` and the controller's ``acrl/*``.
        """
        missing = [k for k in TRAIN_KEYS if k not in batch]
        if missing:
            raise KeyError(f"train batch is missing {missing}")
        signal = None
        if self.controller is not None:
            signal = self.controller.signal()
        mask = batch["loss_mask"].float()
        num_tokens = mask.sum()
        num_seqs = (mask.sum(-1) > 0).sum().float()
        source = self._replay_source(batch, training=True)  # MoE routing replay (R3 / R2)
        if source is not None:
            batch = dict(batch, replay_experts=source)
        micro = self._micro_batches(batch, TRAIN_KEYS + ("ref_logprobs", "replay_experts"))
        loss_func_for = partial(
            self.adapter.train_loss_func,
            acrl=signal,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            num_microbatches=len(micro),
            dp_size=self.dp_size,
        )
        if self.routing is not None:
            self.routing.begin(replay=source is not None, observe=False)
        try:
            metrics = self._optimizer_step(micro, loss_func_for)
        finally:
            if self.routing is not None:
                self.routing.end()
        if self.controller is not None:
            metrics.update(self.controller.metrics())
        return metrics

    # ----------------------------------------------------------------------------------------
    # Weights: HF export and load (the streaming itself lives in MegatronModel)
    # ----------------------------------------------------------------------------------------

    def save_hf(self, directory: str | os.PathLike, max_shard_bytes: int = 2 << 30) -> None:
        """Write an HF checkpoint (``config.json`` + safetensors shards) from rank 0; all ranks call it.

        Tensors stream through :meth:`hf_weights`; rank 0 holds at most one shard in memory.
        """
        from safetensors.torch import save_file

        out = Path(directory)
        rank0 = dist.get_rank() == 0
        if rank0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(convert.hf_config(self.cfg.model), indent=2))
        shard: dict[str, torch.Tensor] = {}
        size, index, files = 0, {}, 0

        def flush() -> None:
            nonlocal shard, size, files
            if shard:
                name = f"model-{files:05d}.safetensors"
                save_file(shard, str(out / name), metadata={"format": "pt"})
                index.update(dict.fromkeys(shard, name))
                shard, size, files = {}, 0, files + 1

        for name, tensor in self.hf_weights(all_stages=True):
            if not rank0:
                continue
            shard[name] = tensor.detach().to("cpu").contiguous().clone()
            size += tensor.numel() * tensor.element_size()
            if size >= max_shard_bytes:
                flush()
        if rank0:
            flush()
            (out / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": index}, indent=2)
            )
        dist.barrier()

    def load_hf(self, source: str | os.PathLike | Mapping[str, torch.Tensor]) -> None:
        """Load HF weights into the policy (and copy them into the reference model)."""
        super().load_hf(source)
        if self.ref_model is not None:
            self._copy_policy_to_ref()

    @torch.no_grad()
    def _copy_policy_to_ref(self) -> None:
        assert self.ref_model is not None
        for src, dst in zip(self.model, self.ref_model, strict=True):
            for p, q in zip(unwrap(src).parameters(), unwrap(dst).parameters(), strict=True):
                q.copy_(p)

    # ----------------------------------------------------------------------------------------
    # Checkpoints (distributed; see MegatronModel and save_step_atomically)
    # ----------------------------------------------------------------------------------------

    def sharded_state_dict(self, is_loading: bool = False) -> dict[str, Any]:
        """:meth:`MegatronModel.sharded_state_dict` plus the ACRL controller (common state: it is
        identical on every rank). The reference model is not saved: it is the initial weights,
        reloaded by ``load_hf`` when the run starts."""
        state = super().sharded_state_dict(is_loading)
        state["controller"] = self.controller.state_dict() if self.controller is not None else None
        return state

    def load_dist(self, path: str | os.PathLike) -> None:
        """:meth:`MegatronModel.load_dist` plus the controller."""
        super().load_dist(path)
        if self.controller is not None:
            saved = dist_checkpointing.load_common_state_dict(str(path)).get("controller")
            if saved is not None:
                self.controller.load_state_dict(saved)

    def save_checkpoint(
        self, directory: str | os.PathLike, also: Sequence[Callable[[Path], None]] = ()
    ) -> Path:
        """Write ``directory/step_<n>/policy`` (all ranks call it) and commit the step.

        ``also`` are writers of the step's other state (the driver's, the critic's), called with
        the temporary step directory before the commit, so one commit covers all of them; see
        :func:`save_step_atomically`.
        """
        return save_step_atomically(
            directory, self.step, [lambda d: self.save_dist(d / self.ckpt_kind), *also]
        )

    def load_checkpoint(self, directory: str | os.PathLike) -> bool:
        """Resume from ``directory/latest.json`` if present; returns whether a checkpoint was loaded."""
        return self._load_latest(directory, None)


CHECKPOINT_BACKEND = "torch_dist"

_CHECKPOINT_MODEL_FIELDS = (
    "family",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "qk_layernorm",
    "add_qkv_bias",
    "tie_embeddings",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_ffn_hidden_size",
    "params_dtype",
)
"""Model fields that fix a checkpointed tensor's global shape or dtype (or its presence)."""


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root``): what rank 0 wrote (common
    state, metadata, the driver's file) is otherwise only in the page cache; the ``.distcp`` shards
    were fsynced by their writers already, a second fsync costs nothing."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_latest(root: Path, step: int, name: str) -> None:
    latest = root / "latest.json"
    tmp = root / f".latest.json.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps({"step": step, "dir": name}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, latest)
    _fsync_dir(root)


def save_step_atomically(
    directory: str | os.PathLike, step: int, writers: Sequence[Callable[[Path], None]]
) -> Path:
    """Write a checkpoint of ``step`` so that a crash at any point leaves the last good one loadable.

    Every rank calls it. The writers fill ``directory/.tmp-step_<n>/`` (each is called on every
    rank with that path); then rank 0 fsyncs the tree, renames it to ``step_<n>/`` and replaces
    ``latest.json`` (temporary file, fsync, ``os.replace``, fsync of the directory): the commit
    point. A crash before the rename leaves only a ``.tmp-`` directory (removed by the next save);
    one between the rename and ``latest.json`` leaves an uncommitted ``step_<n>/`` that
    ``latest.json`` does not name (replaced by the next save of that step). Returns ``step_<n>/``.
    """
    root = Path(directory)
    final, tmp = root / _step_name(step), root / f".tmp-{_step_name(step)}"
    rank0 = dist.get_rank() == 0
    if rank0:
        if tmp.exists():  # a crashed save of the same step
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    for write in writers:
        write(tmp)
    dist.barrier()  # every rank's files are complete
    if rank0:
        _fsync_tree(tmp)
        trash = None
        if final.exists():  # saved before (uncommitted, or committed and now superseded)
            trash = root / f".trash-{final.name}"
            if trash.exists():
                shutil.rmtree(trash)
            os.rename(final, trash)  # resolve_step_dir falls back to it until the next rename
        os.rename(tmp, final)
        _fsync_dir(root)
        _write_latest(root, step, final.name)
        if trash is not None:
            shutil.rmtree(trash)
    dist.barrier()
    return final


def resolve_step_dir(directory: str | os.PathLike, step: int | None = None) -> Path | None:
    """``directory/step_<step>`` or, with ``step=None``, the step directory ``latest.json`` names
    (None when there is no ``latest.json``: nothing was ever committed there)."""
    root = Path(directory)
    if step is None:
        latest = root / "latest.json"
        if not latest.exists():
            return None
        name = json.loads(latest.read_text())["dir"]
    else:
        name = _step_name(step)
    found = root / name
    if not found.exists() and (root / f".trash-{name}").exists():
        return root / f".trash-{name}"  # a crash mid-replacement of the same step (see above)
    if not found.exists():
        raise FileNotFoundError(f"{found} is missing: checkpoint {name} was removed or never committed")
    return found


def _hf_getter(source: str | os.PathLike | Mapping[str, torch.Tensor]):  # noqa: ANN202
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
