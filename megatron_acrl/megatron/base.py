"""The machinery every trained Megatron-Core model shares: parallel state, DDP, optimizer, schedule.

Process groups are read once (``ProcessGroupCollection.use_mpu_process_groups()``) after
:func:`initialize_parallel` and passed explicitly to the model, DDP, the optimizer, the schedule and
our own collectives. Every rank holds the whole batch (the driver broadcasts it) and computes the
same micro-batch plan from it (``megatron_acrl.batch.microbatch``: fixed micro_batch_size slices, or
token-budget micro-batches with balanced tokens per data-parallel rank), so the global loss
denominators are known locally without a collective.

Rank roles:
  * the last pipeline stage computes the loss (the subclass's loss adapter) and the forward-only
    outputs;
  * metrics and forward-only outputs are reduced over DP on the last stage, then broadcast over the
    pipeline group so every rank (rank 0 drives the loop and sits on the first stage) has them.

:class:`ModelTrainer` is the base of ``policy.Policy`` and ``critic.Critic``; HF weights go through
``hf_io``, distributed checkpoints through ``checkpoint``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_acrl.batch.microbatch import MicroBatchPlan, budget_plan, fixed_plan, row_lengths
from megatron_acrl.config import Config, ParallelConfig
from megatron_acrl.correction import combine_partials, finalize_metrics
from megatron_acrl.megatron import checkpoint, convert, cpu_compat, hf_io, lora
from megatron_acrl.megatron.collectives import all_reduce_partials
from megatron_acrl.megatron.model import build_model_chunks, padded_vocab_size, transformer_config, unwrap
from megatron_acrl.megatron.routing_replay import RoutingReplay

__all__ = ["ModelTrainer", "initialize_parallel"]

LossFuncFor = Callable[[dict], Callable]
"""Micro-batch -> the loss (or collect) function Megatron's schedule calls on its output."""


def initialize_parallel(parallel: ParallelConfig, seed: int) -> None:
    """Create Megatron's process groups for ``parallel`` and seed the model-parallel RNG.

    ``torch.distributed`` must already be initialised (gloo on CPU, nccl on GPU), and on a host
    without CUDA ``cpu_compat.apply()`` must have run (RuntimeError naming it otherwise). Call
    ``parallel_state.destroy_model_parallel()`` before re-initialising with another layout.
    """
    cpu_compat.require()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        expert_model_parallel_size=parallel.ep,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


class ModelTrainer:
    """Trains one Megatron-Core GPT model with its own optimizer: the shared base of ``Policy`` (the
    policy) and ``Critic`` (the PPO value model).

    Holds the DDP-wrapped chunks of this rank, the Megatron optimizer and LR schedule, and the
    pieces both models drive the same way: micro-batching (:meth:`micro_batch_plan`), the pipeline
    schedule, the forward-only gather (last stage -> every rank), one optimizer step with reduced
    metrics, HF weights in and out (``hf_io``) and distributed checkpoints (``checkpoint``).

    Subclasses customise the model through :meth:`_build_chunks`, the HF mapping of their own
    parameters through :meth:`_to_hf` / :meth:`_from_hf`, and their checkpoint through
    :attr:`ckpt_kind` / :meth:`_chunk_sharded_state_dict`.

    Args:
        cfg: the run configuration.
        pg_collection: process groups; None reads Megatron's (``initialize_parallel`` first).
        total_steps: optimizer steps of the LR schedule (default ``num_steps * ppo_epochs *
            num_minibatches``).
    """

    routing: RoutingReplay | None = None
    """MoE routing replay / observation of this model's routers (the policy's; None elsewhere)."""

    ckpt_kind = "policy"
    """Subdirectory of a step directory holding this model's distributed checkpoint."""

    uses_lora = False
    """Whether ``model.lora`` applies to this model (the policy's; a critic trains every weight)."""

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
        self.layout = hf_io.ParamLayout(
            self.config, pg, num_experts=cfg.model.num_experts, virtual_pipeline=bool(cfg.parallel.vpp)
        )
        self.ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.parallel.distributed_optimizer,
            # 1/dp pre-scaling (not an AVG collective, which gloo lacks); the adapter undoes it.
            average_in_collective=False,
        )
        t = cfg.training
        if self.pp_size > 1 and (t.max_tokens_per_microbatch or t.logprob_token_budget):
            # Token-budget micro-batches differ in shape: the pipeline stages exchange each
            # activation's shape before the activation (Megatron's p2p shape handshake).
            self.config.variable_seq_lengths = True
        self.model = self._wrap_ddp(self._build_chunks())
        self.optimizer = self._build_optimizer()
        self.scheduler = self._build_scheduler(total_steps)
        self.step = 0
        # what a LoRA checkpoint records of the frozen base (set by load_hf; randomly initialised here)
        self.base_ref: dict[str, Any] = {"path": None, "sha256": f"random init, training.seed={t.seed}"}
        # the learning-rate multiplier of the coming optimizer steps (correction.step_control): applied
        # to the param groups around optimizer.step() only, so the scheduler never sees it
        self.lr_scale = 1.0

    @property
    def lora(self) -> Any:
        """This model's ``LoraConfig`` (None: every weight trains)."""
        return self.cfg.model.lora if self.uses_lora else None

    def _build_chunks(self) -> list[torch.nn.Module]:
        """This rank's (not yet DDP-wrapped) model chunks; subclasses may change their heads. With
        LoRA the base is frozen and adapters attached (:func:`lora.apply_lora`) before DDP and the
        optimizer see the parameters, so both hold the adapters only."""
        chunks = build_model_chunks(self.cfg.model, self.cfg.parallel, self.config, self.pg)
        if self.lora is not None:
            vpp = self.cfg.parallel.vpp
            offsets = [
                get_transformer_layer_offset(self.config, vp_stage=i if vpp else None, pp_rank=self.pp_rank)
                for i in range(len(chunks))
            ]
            lora.apply_lora(chunks, self.cfg, self.config, self.pg, offsets)
        return chunks

    def _wrap_ddp(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        """DDP-wrap the chunks and hand Megatron's schedule their no-sync and grad-finalize hooks."""
        model = [
            DistributedDataParallel(
                self.config, self.ddp_config, c, disable_bucketing=i > 0, pg_collection=self.pg
            )
            for i, c in enumerate(chunks)
        ]
        self.config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = None
        return model

    def _build_optimizer(self) -> Any:
        """Megatron's (chained, possibly distributed) AdamW over the DDP chunks."""
        t = self.cfg.training
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
            use_distributed_optimizer=self.cfg.parallel.distributed_optimizer,
        )
        return get_megatron_optimizer(
            self.opt_config, self.model, use_gloo_process_groups=False, pg_collection=self.pg
        )

    def _build_scheduler(self, total_steps: int | None) -> OptimizerParamScheduler:
        """Warmup + cosine LR over ``total_steps`` optimizer steps, constant weight decay."""
        t, a = self.cfg.training, self.cfg.algorithm
        steps = total_steps or max(1, t.num_steps * a.ppo_epochs * a.num_minibatches)
        return OptimizerParamScheduler(
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

    # ----------------------------------------------------------------------------------------
    # Batches and the schedule
    # ----------------------------------------------------------------------------------------

    def _seq_multiple(self) -> int:
        # Sequence parallelism scatters the sequence over TP ranks.
        return self.tp_size if self.config.sequence_parallel else 1

    def _padded_len(self, length: int) -> int:
        """``length`` rounded up to a sequence length Megatron accepts under this layout."""
        mult = self._seq_multiple()
        return -(-length // mult) * mult

    def micro_batch_plan(
        self, batch: Mapping[str, torch.Tensor], *, forward_only: bool = False
    ) -> MicroBatchPlan:
        """How ``batch`` (``tokens [N, L]``, optionally ``loss_mask [N, L]``) is cut on every DP rank:
        by the token budget (``training.max_tokens_per_microbatch``, or for a forward-only pass
        ``logprob_token_budget``) or, without one, into ``micro_batch_size`` contiguous sequences
        padded to L. The same on every rank (a pure function of the batch)."""
        n, length = batch["tokens"].shape
        t = self.cfg.training
        budget = t.logprob_token_budget if forward_only else t.max_tokens_per_microbatch
        if budget is None:
            return fixed_plan(
                row_lengths(batch.get("loss_mask"), n, length),
                dp=self.dp_size,
                micro_batch_size=t.micro_batch_size,
                width=self._padded_len(length),
            )
        lengths = row_lengths(batch.get("loss_mask"), n, length)
        return budget_plan(
            lengths,
            dp=self.dp_size,
            budget=budget,
            multiple=self._seq_multiple(),
            # Megatron's interleaved schedule runs micro-batches in groups of pp.
            count_multiple=self.pp_size if self.cfg.parallel.vpp else 1,
        )

    def _micro_batches(
        self, batch: Mapping[str, torch.Tensor], keys: tuple[str, ...], *, forward_only: bool = False
    ) -> tuple[list[dict], MicroBatchPlan]:
        """This DP rank's micro-batches of ``batch`` (``[N, L]`` tensors, ``[N, L, layers, k]``
        routing) under :meth:`micro_batch_plan`: each ``[b, L']`` with its rows cut or right-padded to
        its own length ``L'``, plus ``position_ids [b, L']``; and the plan."""
        plan = self.micro_batch_plan(batch, forward_only=forward_only)
        length = batch["tokens"].shape[1]
        micro = []
        for m in plan.ranks[self.dp_rank]:
            rows = torch.tensor(m.rows, dtype=torch.long)
            mb = {}
            for k in keys:
                if k not in batch:
                    continue
                v = batch[k].index_select(0, rows)[:, : m.length]
                if m.length > length and v.dim() > 2:  # [b, L, layers, k] routing: -1 = unknown
                    v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, m.length - length), value=-1)
                elif m.length > length:  # pad tokens/masks/log-probs with zeros: masked, never scored
                    v = torch.nn.functional.pad(v, (0, m.length - length))
                mb[k] = v.contiguous()
            mb["position_ids"] = torch.arange(m.length).unsqueeze(0).expand(len(m.rows), -1).contiguous()
            micro.append(mb)
        return micro, plan

    def _run_schedule(
        self,
        model: list[torch.nn.Module],
        micro: list[dict],
        loss_func_for: LossFuncFor,
        forward_only: bool,
        collect: bool,
    ) -> list[Any]:
        """Megatron's pipeline schedule over ``micro``; returns the last stage's per-micro-batch
        outputs of ``loss_func_for(mb)`` (empty elsewhere)."""
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
        collect_for: LossFuncFor,
        keys: list[str],
    ) -> dict[str, torch.Tensor]:
        """Run ``model`` forward-only over ``batch["tokens"] [N, L]`` and return ``{key: [N, L]}`` on
        every rank: micro-batch outputs (``collect_for(mb)`` returns ``{key: [b, L']}``) are
        concatenated and cut back to L on the last stage, all-gathered over DP (ranks hold contiguous
        slices, so rank order is batch order), then broadcast over the pipeline group."""
        for chunk in model:
            chunk.eval()
        micro, plan = self._micro_batches(batch, ("tokens", "replay_experts"), forward_only=True)
        out = self._run_schedule(model, micro, collect_for, True, True)
        n, length = batch["tokens"].shape
        result: dict[str, torch.Tensor] | None = None
        if self.is_last_stage:
            result = {}
            for k in keys:
                # Each row has one owner (a DP rank, a micro-batch): scatter into zeros, sum over DP.
                full = torch.zeros(n, length, dtype=out[0][k].dtype)
                for m, o in zip(plan.ranks[self.dp_rank], out, strict=True):
                    cut = min(m.length, length)
                    full[torch.tensor(m.rows, dtype=torch.long), :cut] = o[k][:, :cut]
                if self.dp_size > 1:
                    dist.all_reduce(full, group=self.pg.dp)
                result[k] = full
        result = self._broadcast_from_last_stage(result)
        for chunk in self.model:
            chunk.train()
        return result

    def _optimizer_step(self, micro: list[dict], loss_func_for: LossFuncFor) -> dict[str, float]:
        """Forward/backward over ``micro`` under the schedule, then one optimizer and LR step.

        Returns the loss function's partial metrics reduced over micro-batches and DP (same on every
        rank), plus ``grad_norm``, ``lr`` (the rate this step used) and ``update_successful``.
        """
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._run_schedule(self.model, micro, loss_func_for, False, False)
        lr = float(self.optimizer.param_groups[0]["lr"]) * self.lr_scale  # the rate this step uses
        ok, grad_norm = self._scaled_optimizer_step()
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

    def _scaled_optimizer_step(self) -> tuple[bool, Any]:
        """``optimizer.step()`` with every param group's rate times :attr:`lr_scale`, restored after.

        The scheduler wrote the groups' rates (``lr_mult`` included) after the previous step and
        writes them again after this one; the scale lives only inside this call, so the schedule,
        its state and the checkpoint are those of an unscaled run. A scale of 1 touches nothing.
        """
        groups = self.optimizer.param_groups
        scale = self.lr_scale
        saved = [g["lr"] for g in groups] if scale != 1.0 else None
        if saved is not None:
            for g in groups:
                g["lr"] = g["lr"] * scale
        try:
            ok, grad_norm, _ = self.optimizer.step()
        finally:
            if saved is not None:
                for g, lr in zip(groups, saved, strict=True):
                    g["lr"] = lr
        return ok, grad_norm

    # ----------------------------------------------------------------------------------------
    # HF weights (hf_io): the stream and the reader, with this model's name mapping
    # ----------------------------------------------------------------------------------------

    def _to_hf(self, name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """HF ``(name, tensor)`` pairs of one full canonical Megatron tensor."""
        return convert.megatron_to_hf(name, full, self.info)

    def _from_hf(self, name: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The full canonical Megatron tensor ``name`` built from HF tensors (``get(hf_name)``)."""
        return convert.hf_to_megatron(name, get, self.info, padded_vocab=self.padded_vocab)

    def hf_weights(
        self, all_stages: bool = False, *, merged: bool | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``(hf_name, full tensor)`` pairs of this model (see :func:`hf_io.hf_weights`);
        every rank must iterate. ``merged``: with LoRA, see :meth:`_stream_to_hf`."""
        return hf_io.hf_weights(self.model, self.layout, self._stream_to_hf(merged), all_stages=all_stages)

    def _stream_to_hf(self, merged: bool | None) -> hf_io.ToHf:
        """The ``to_hf`` of a full-weight stream. With LoRA: ``merged=True`` folds the adapters into
        the weights (``W + (alpha/r) B A``; the adapters are gathered here, a collective), False sends
        the frozen base, None follows ``model.lora.sync`` (merged: fold; adapter: refused, since the
        full-weight sync would serve the base without the adapters)."""
        lo = self.lora
        if lo is None or merged is False:
            return self._to_hf
        if merged is None and lo.sync == "adapter":
            raise RuntimeError(
                "model.lora.sync=adapter: the servers get the adapters (Policy.adapter_state, "
                "lora.peft_adapter_config) through their LoRA engine, not the full-weight sync, which "
                "would serve the base without them; set model.lora.sync=merged to push merged weights"
            )
        return lora.merged_to_hf(self._to_hf, lora.full_adapters(self.model, self.layout))

    def adapter_state(self, dst: int | None = 0) -> dict[str, torch.Tensor]:
        """The adapters as ``{PEFT name: full CPU tensor}`` on global rank ``dst`` (None: every
        rank), see :func:`lora.adapter_state`; every rank calls it. ValueError without LoRA."""
        if self.lora is None:
            raise ValueError("model.lora is null: this model has no adapters")
        return lora.adapter_state(self.model, self.layout, self.info, dst=dst)

    def load_adapter_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Set the adapters from full PEFT tensors (:meth:`adapter_state`'s names) on every rank."""
        lora.load_adapter_state(self.model, self.layout, self.info, state)
        self.optimizer.reload_model_params()

    @property
    def sync_source(self) -> hf_io.SyncSource | None:
        """This rank's part in a per-source weight sync (None: it sends nothing itself)."""
        return hf_io.sync_source(self.layout)

    def hf_source_meta(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """``(hf_name, shape, dtype)`` of what :meth:`hf_source_weights` yields, nothing gathered."""
        return hf_io.source_meta(self.model, self.layout, self._to_hf)

    def hf_source_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's weights as a sync source (see :func:`hf_io.source_weights`); every rank must
        iterate (with ``model.lora.sync=merged``: merged, see :meth:`_stream_to_hf`)."""
        return hf_io.source_weights(self.model, self.layout, self._stream_to_hf(None))

    def load_hf(self, source: hf_io.HfSource) -> None:
        """Load HF weights (a safetensors file/directory or a name -> tensor mapping) into the model.
        Every rank reads only the tensors its shards need."""
        hf_io.load_hf(self.model, self.layout, source, self._from_hf)
        if self.lora is not None:  # the base a LoRA checkpoint must be resumed on
            self.base_ref = lora.base_reference(source)
        self.optimizer.reload_model_params()  # refresh fp32 main params (bf16 / distributed opt.)

    # ----------------------------------------------------------------------------------------
    # Distributed checkpoints (checkpoint): torch_dist, reshardable over TP/PP/EP/DP
    # ----------------------------------------------------------------------------------------

    def sharded_state_dict(self, is_loading: bool = False) -> dict[str, Any]:
        """This rank's training state for ``dist_checkpointing``: ShardedTensors of the model
        chunks (global names and offsets, so any layout can read them) and of the optimizer state;
        the LR schedule, step and :meth:`_checkpoint_meta` are common state (written by rank 0)."""
        meta = checkpoint.sharded_metadata(self.pg.dp_cp)
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
        """One model chunk's sharded state dict (subclasses with another head adapt it). With LoRA
        the adapters only: the frozen base is the model at ``model.hf_path``, which the checkpoint
        references (:meth:`_checkpoint_meta`) instead of copying."""
        state = unwrap(chunk).sharded_state_dict(metadata=meta)
        if self.lora is not None:
            state = {k: v for k, v in state.items() if lora.is_lora_param(k)}
        return state

    def _checkpoint_meta(self) -> dict[str, Any]:
        lo = self.lora
        adapters = None
        if lo is not None:
            adapters = dict(rank=lo.rank, alpha=lo.alpha, target_modules=list(lo.target_modules))
            adapters["base"] = self.base_ref
        return checkpoint.checkpoint_meta(self.cfg, self.ckpt_kind, self.optimizer, self.dp_size, adapters)

    def save_dist(self, path: str | os.PathLike) -> None:
        """Write this model's distributed checkpoint into ``path`` (all ranks call it)."""
        checkpoint.save_dist(self.sharded_state_dict(), path, self.pg.dp_cp)

    def load_dist(self, path: str | os.PathLike) -> None:
        """Load a distributed checkpoint written by :meth:`save_dist` under any TP/PP/VPP/EP/DP layout.

        Raises ConfigError naming every mismatched model field when the checkpoint belongs to
        another model (before any tensor is read, instead of a shape error deep in the loader).
        """
        path = Path(path)
        checkpoint.check_compatible(path, self._checkpoint_meta())
        state = checkpoint.load_dist(self.sharded_state_dict(is_loading=True), path, self.pg.dp_cp)
        only = lora.is_lora_param if self.lora is not None else None
        checkpoint.load_chunks(self.model, state["model"], path, only=only)
        self.optimizer.load_state_dict(state["optimizer"])
        # No reload_model_params() here: the bf16 optimizer's load_state_dict has just restored the
        # fp32 main params, and copying the bf16 model params over them would round them to bf16
        # (a resumed bf16 run then drifts from the uninterrupted one); fp32 models have no copy.
        self.scheduler.num_steps = 0  # Megatron's load_state_dict *adds* the saved step count
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])

    def _load_latest(self, directory: str | os.PathLike, step: int | None) -> bool:
        """Load ``<step dir>/<ckpt_kind>`` of ``step`` or of the one ``latest.json`` names."""
        found = checkpoint.resolve_step_dir(directory, step)
        if found is None:
            return False
        self.load_dist(found / self.ckpt_kind)
        return True
