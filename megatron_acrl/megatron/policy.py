"""The RL policy on Megatron-Core: forward-only log-probs, one optimizer step, the ACRL controller.

:class:`Policy` is a :class:`~megatron_acrl.megatron.base.ModelTrainer` (parallel state, DDP,
optimizer, schedule) with the RL loss adapter, an optional frozen reference model (KL term), the
ACRL controller's collectives, MoE routing replay (``routing_replay``) and the checkpoint entry
points of a training step.

Rank roles beyond the base's: the ACRL controller is updated on the last stage from DP-all-reduced
statistics and its state is broadcast over the pipeline group, so all ranks agree.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_acrl.algo.advantages import compute_advantages
from megatron_acrl.algo.losses import PolicyLoss
from megatron_acrl.batch.train_batch import TrainBatch, check_train_batch
from megatron_acrl.config import Config
from megatron_acrl.correction import (
    AcrlController,
    DriftBudgetController,
    MismatchTensors,
    acrl_discrepancy_stats,
    batch_weight_mean,
    drift_stats,
    valid_mask,
)
from megatron_acrl.megatron import checkpoint, convert, hf_io, lora
from megatron_acrl.megatron.base import ModelTrainer
from megatron_acrl.megatron.loss_adapter import LossAdapter
from megatron_acrl.megatron.model import build_model_chunks, transformer_config, unwrap
from megatron_acrl.megatron.routing_replay import (
    RoutingReplay,
    routing_mismatch_metrics,
    routing_mismatch_sums,
)

if TYPE_CHECKING:
    from megatron_acrl.megatron.critic import Critic

__all__ = ["TRAIN_KEYS", "Policy"]

TRAIN_KEYS = ("tokens", "loss_mask", "old_logprobs", "rollout_logprobs", "advantages")
"""Keys of a policy training batch, all ``[N, L]``."""


class Policy(ModelTrainer):
    """Megatron-Core policy (and optional reference model) for RL post-training.

    Args:
        cfg: the run configuration.
        pg_collection: process groups; None reads Megatron's (``initialize_parallel`` first).
        loss_fn: the pure loss, its settings bound (default ``megatron_acrl.algo.losses.RLLoss``
            of the config; the SFT warm start passes ``sft_loss``).
        total_steps: optimizer steps of the LR schedule (default ``num_steps * ppo_epochs *
            num_minibatches``).
    """

    uses_lora = True  # model.lora: adapters on the policy (the reference model stays the plain base)

    def __init__(
        self,
        cfg: Config,
        *,
        pg_collection: ProcessGroupCollection | None = None,
        loss_fn: PolicyLoss | None = None,
        total_steps: int | None = None,
    ) -> None:
        super().__init__(cfg, pg_collection=pg_collection, total_steps=total_steps)
        a = cfg.algorithm
        self.ref_model: list[torch.nn.Module] | None = None
        if a.kl_coef > 0:
            ref_config = transformer_config(cfg.model, cfg.parallel)
            ref_config.variable_seq_lengths = self.config.variable_seq_lengths  # same micro-batches
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
        self.controller = (
            AcrlController(cfg.correction, reference_lag=cfg.acrl_reference_lag)
            if cfg.correction.method == "acrl"
            else None
        )
        self.step_controller = (
            DriftBudgetController(cfg.correction) if cfg.correction.step_control == "drift_budget" else None
        )
        self._own_routing: torch.Tensor | None = None  # [N, L, local MoE layers, k], last pi_old pass
        self._applied_routing: torch.Tensor | None = None  # what those routers used (after replay)
        if cfg.model.is_moe:
            self.routing = RoutingReplay(
                self.model, sequence_parallel=self.config.sequence_parallel, tp_group=self.pg.tp
            )

    # ----------------------------------------------------------------------------------------
    # The step's train batch, assembled once
    # ----------------------------------------------------------------------------------------

    def prepare(
        self, tb: TrainBatch, *, trainer_version: int, critic: Critic | None = None
    ) -> tuple[TrainBatch, dict[str, float]]:
        """Complete a rollout batch into the step's train batch; every rank calls it, once per step.

        In order: pi_old (:meth:`forward_logprobs`; under R2 its ``recorded_experts``, which the
        training pass replays), the routing mismatch (:meth:`routing_metrics`), the reference
        log-probs (``algorithm.kl_coef`` > 0), the critic's values (PPO), the advantages (and PPO's
        returns, :func:`~megatron_acrl.algo.advantages.compute_advantages`) and the controllers'
        update (ACRL's and the drift-budget step controller's, :meth:`update_controller`, once per
        rollout batch, before its first optimizer step: the step controller sets :attr:`lr_scale`).
        The result is checked once (:func:`~megatron_acrl.batch.train_batch.check_train_batch`).

        Args:
            tb: the rollout batch (:meth:`RolloutBatch.tensors`); not modified.
            trainer_version: the weight version about to be trained (the step); the batch's sampling
                lag is measured against it.
            critic: the PPO critic, or None.
        Returns:
            ``(train batch, metrics)``: the batch with ``old_logprobs``, ``advantages`` and, as the run
            needs them, ``recorded_experts``, ``ref_logprobs``, ``values``, ``returns`` (module doc of
            :mod:`megatron_acrl.batch.train_batch`); ``routing/*``, ``advantages/*`` (PPO:
            ``critic/*``), ``acrl/*`` and ``step_control/*`` metrics.
        """
        tb = TrainBatch(**tb)  # a new dict: the caller's batch keeps its keys
        old = self.forward_logprobs(tb)  # pi_old (MoE: replays / observes the routing)
        tb["old_logprobs"] = old["logprobs"]
        if "recorded_experts" in old:  # R2: the training pass replays this pass's routing
            tb["recorded_experts"] = old["recorded_experts"]
        metrics = self.routing_metrics(tb)  # MoE: trainer-vs-rollout routing mismatch
        need = ["old_logprobs", "advantages"]
        if self.cfg.algorithm.kl_coef > 0:
            tb["ref_logprobs"] = self.forward_logprobs(tb, reference=True)["logprobs"]
            need.append("ref_logprobs")
        if critic is not None:  # PPO: V(s_t) before the update; GAE in compute_advantages
            tb["values"] = critic.forward_values(tb)["values"]
            need += ["values", "returns"]
        adv = compute_advantages(tb, self.cfg)
        tb["advantages"] = adv.advantages
        if adv.returns is not None:
            tb["returns"] = adv.returns
        metrics.update(adv.metrics)
        metrics.update(self.update_controller(tb, trainer_version=trainer_version))
        check_train_batch(tb, need)
        return tb, metrics

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
        rollout_experts = batch["routed_experts"][:, :, self.routing.layers]
        scored = dict(
            old_logprobs=batch["old_logprobs"],
            rollout_logprobs=batch["rollout_logprobs"],
            loss_mask=batch["loss_mask"],
        )
        n_layers = self.cfg.model.num_layers
        out: dict[str, float] = {}
        # Before replay (the router's own choice), then what the routers actually used.
        for own, suffix in ((self._own_routing, ""), (self._applied_routing, "_applied")):
            sums_local, flips = routing_mismatch_sums(own, rollout_experts, **scored)
            sums = torch.zeros(n_layers, sums_local.shape[1], dtype=torch.float64)
            sums[self.routing.layers] = sums_local
            if self.pp_size > 1:
                dist.all_reduce(sums, group=self.pg.pp)
                dist.all_reduce(flips, group=self.pg.pp)
            m = routing_mismatch_metrics(sums, flips, **scored, layers=range(n_layers))
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
        if observe and len(routing):  # this stage has MoE layers
            out = self._keep_routing(batch, routing, observed, applied, out)
        return out

    def sequence_logprobs(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """Teacher-forced log-probability of each sequence's masked tokens on the policy's weights,
        at temperature 1 (the exact metric, :mod:`megatron_acrl.rollout.evaluate`); all ranks call it.

        Args:
            tokens: ``[N, L]`` int64, the same on every rank, any N (padded here to whole
                micro-batches on every data-parallel rank, and cut back).
            loss_mask: ``[N, L]``, 1 on the tokens to score.
        Returns:
            ``[N]`` float64 on every rank: ``sum_t mask[n, t] * log p(tokens[n, t] | tokens[n, :t])``.
        MoE routers route freely (the trainer's own choice: there is no rollout routing to replay).
        """
        n = tokens.shape[0]
        pad = -n % (self.dp_size * self.cfg.training.micro_batch_size)
        if pad:
            tokens = torch.cat([tokens, tokens[:1].expand(pad, -1)])
        temperature, self.adapter.temperature = self.adapter.temperature, 1.0
        try:  # _forward_only directly: no routing replay is begun, so routers route freely
            out = self._forward_only(
                self.model,
                {"tokens": tokens},
                lambda mb: self.adapter.forward_only_func(mb, False),
                ["logprobs"],
            )
        finally:
            self.adapter.temperature = temperature
        return (out["logprobs"][:n].double() * loss_mask.double()).sum(-1)

    def _keep_routing(
        self,
        batch: Mapping[str, torch.Tensor],
        routing: RoutingReplay,
        observed: Any,
        applied: Any,
        out: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Keep the pi_old pass's observed routing (own choice, and what the routers used), assembled
        into ``[N, L, local MoE layers, k]``, for :meth:`routing_metrics`; under R2 also return it."""
        n, length = batch["tokens"].shape
        plan = self.micro_batch_plan(batch, forward_only=True)  # the plan the pass just ran
        shape = dict(
            num_seqs=n,
            seq_len=length,
            micro=[(m.rows, m.length) for m in plan.ranks[self.dp_rank]],
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

    def update_controller(
        self, batch: Mapping[str, torch.Tensor], trainer_version: int | None = None
    ) -> dict[str, float]:
        """Observe one rollout batch (call once, before its first optimizer step).

        Statistics of this DP rank's sequences are all-reduced (SUM) over DP on the last stage,
        the controllers (ACRL's, the drift-budget step controller) are updated there and their state
        broadcast over the pipeline group. With ``trainer_version`` and the batch's
        ``token_versions`` ``[N, L]``, the batch's sampling lag decides whether it may be measured
        into ACRL's reference (``correction.reference_lag``), and its lag-0 tokens give the step
        controller's reference drift. The step controller's scale becomes :attr:`lr_scale`, the
        multiplier of this batch's optimizer steps. Returns the controllers' metrics.
        """
        if self.controller is None and self.step_controller is None:
            return {}
        state = None
        if self.is_last_stage:
            n = batch["tokens"].shape[0]
            per_rank = n // self.dp_size
            sl = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
            old, roll = batch["old_logprobs"][sl].float(), batch["rollout_logprobs"][sl].float()
            sh = MismatchTensors(old, roll, batch["loss_mask"][sl], fused=self.adapter.fused)
            state = {}
            if self.controller is not None:
                stats = acrl_discrepancy_stats(sh, self.cfg.correction.distance)
                dist.all_reduce(stats, group=self.pg.dp)
                self.controller.update(stats, lag=batch_lag(batch, trainer_version))
                state["acrl"] = self.controller.state_dict()
            if self.step_controller is not None:
                lag0 = lag0_mask(batch, trainer_version)
                lag0_sh = (
                    sh if lag0 is None else MismatchTensors(old, roll, lag0[sl], fused=self.adapter.fused)
                )
                drift = drift_stats(sh, lag0_sh)
                dist.all_reduce(drift, group=self.pg.dp)
                self.step_controller.update(drift)
                state["step"] = self.step_controller.state_dict()
        state = self._broadcast_from_last_stage(state)
        metrics: dict[str, float] = {}
        if self.controller is not None:
            self.controller.load_state_dict(state["acrl"])
            metrics.update(self.controller.metrics())
        if self.step_controller is not None:
            self.step_controller.load_state_dict(state["step"])
            self.lr_scale = self.step_controller.scale
            metrics.update(self.step_controller.metrics())
        return metrics

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
        # the tokens the loss counts: a NaN/Inf log pi_old or log mu leaves the denominators too
        mask = valid_mask(batch["old_logprobs"], batch["rollout_logprobs"], batch["loss_mask"]).float()
        num_tokens = mask.sum()
        num_seqs = (mask.sum(-1) > 0).sum().float()
        source = self._replay_source(batch, training=True)  # MoE routing replay (R3 / R2)
        if source is not None:
            batch = dict(batch, replay_experts=source)
        micro, plan = self._micro_batches(batch, TRAIN_KEYS + ("ref_logprobs", "replay_experts", "turn_ids"))
        loss_func_for = partial(
            self.adapter.train_loss_func,
            acrl=signal,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            num_microbatches=len(micro),
            dp_size=self.dp_size,
            weight_mean=self._batch_weight_mean(batch, signal),
        )
        if self.routing is not None:
            self.routing.begin(replay=source is not None, observe=False)
        try:
            metrics = self._optimizer_step(micro, loss_func_for)
        finally:
            if self.routing is not None:
                self.routing.end()
        if self.step_controller is not None:
            metrics.update(self.step_controller.metrics())
        if self.controller is not None:
            metrics.update(self.controller.metrics())
            if dist.get_rank() == 0:
                self.controller.check_weights(metrics)
        metrics.update(plan.metrics())  # perf/padding_fraction, perf/microbatches, perf/dp_token_imbalance
        return metrics

    def _batch_weight_mean(self, batch: Mapping[str, torch.Tensor], signal: Any) -> torch.Tensor | None:
        """``correction.batch_normalize``: the minibatch's mean weight, once, before its first
        micro-batch; every rank holds the whole minibatch, so every rank computes the same value."""
        if not (self.cfg.correction.batch_normalize and self.is_last_stage):
            return None
        shared = MismatchTensors(
            batch["old_logprobs"].float(),
            batch["rollout_logprobs"].float(),
            batch["loss_mask"],
            fused=self.adapter.fused,
        )
        return batch_weight_mean(
            self.cfg.correction, shared, advantages=batch["advantages"].float(), acrl=signal,
            turn_ids=batch.get("turn_ids"),
        )  # fmt: skip

    # ----------------------------------------------------------------------------------------
    # Weights: HF export and load (the stream and the reader live in hf_io)
    # ----------------------------------------------------------------------------------------

    def save_hf(
        self,
        directory: str | os.PathLike,
        *,
        base_dir: str | os.PathLike | None = None,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = 2 << 30,
        keep_existing: bool = False,
        merged: bool = True,
    ) -> Path:
        """Write the policy as an HF model directory from rank 0; all ranks call it.

        Tensors stream through :meth:`hf_weights` into :func:`hf_io.write_hf_dir` (rank 0 holds at
        most one shard). ``base_dir``: copy that model directory's config and tokenizer (the served
        model's; ``--export-hf`` and the SFT warm start); without it ``config.json`` is
        ``convert.hf_config`` of the model. ``dtype``: cast the weights (None keeps the model's).
        ``keep_existing``: see :func:`hf_io.write_hf_dir` (a cache entry another run wrote first).
        ``merged``: with LoRA, fold the adapters into the weights (False: the frozen base).
        """
        out = hf_io.write_hf_dir(
            self.hf_weights(all_stages=True, merged=merged),
            directory,
            write=dist.get_rank() == 0,
            config=None if base_dir is not None else convert.hf_config(self.cfg.model),
            base_dir=base_dir,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            keep_existing=keep_existing,
        )
        dist.barrier()
        return out

    def load_hf(self, source: hf_io.HfSource) -> None:
        """Load HF weights into the policy (and copy them into the reference model)."""
        super().load_hf(source)
        if self.ref_model is not None:
            self._copy_policy_to_ref()

    @torch.no_grad()
    def _copy_policy_to_ref(self) -> None:
        assert self.ref_model is not None
        for src, dst in zip(self.model, self.ref_model, strict=True):
            base = [p for n, p in unwrap(src).named_parameters() if not lora.is_lora_param(n)]
            for p, q in zip(base, unwrap(dst).parameters(), strict=True):  # LoRA: the base's weights
                q.copy_(p)

    # ----------------------------------------------------------------------------------------
    # Checkpoints (distributed; see ModelTrainer and checkpoint.save_step_atomically)
    # ----------------------------------------------------------------------------------------

    def sharded_state_dict(self, is_loading: bool = False) -> dict[str, Any]:
        """:meth:`ModelTrainer.sharded_state_dict` plus the ACRL controller (common state: it is
        identical on every rank). The reference model is not saved: it is the initial weights,
        reloaded by ``load_hf`` when the run starts."""
        state = super().sharded_state_dict(is_loading)
        state["controller"] = self.controller.state_dict() if self.controller is not None else None
        if self.step_controller is not None:  # (absent otherwise: a run without it saves what it did)
            state["step_controller"] = self.step_controller.state_dict()
        return state

    def load_dist(self, path: str | os.PathLike) -> None:
        """:meth:`ModelTrainer.load_dist` plus the controller."""
        super().load_dist(path)
        if self.controller is not None:
            saved = checkpoint.load_common_state(path).get("controller")
            if saved is not None:
                self.controller.load_state_dict(saved)
        if self.step_controller is not None:
            saved = checkpoint.load_common_state(path).get("step_controller")
            if saved is not None:  # (a checkpoint from before step control: measured anew)
                self.step_controller.load_state_dict(saved)
                self.lr_scale = self.step_controller.scale

    def save_checkpoint(
        self, directory: str | os.PathLike, also: Sequence[Callable[[Path], None]] = ()
    ) -> Path:
        """Write ``directory/step_<n>/policy`` (all ranks call it) and commit the step.

        ``also`` are writers of the step's other state (the driver's, the critic's), called with
        the temporary step directory before the commit, so one commit covers all of them; see
        :func:`checkpoint.save_step_atomically`.
        """
        return checkpoint.save_step_atomically(
            directory, self.step, [lambda d: self.save_dist(d / self.ckpt_kind), *also]
        )

    def load_checkpoint(self, directory: str | os.PathLike, step: int | None = None) -> bool:
        """Resume from ``directory/step_<step>`` or, by default, the step ``latest.json`` names (if
        present); returns whether a checkpoint was loaded."""
        return self._load_latest(directory, step)


def batch_lag(batch: Mapping[str, torch.Tensor], trainer_version: int | None) -> int | None:
    """The largest lag ``trainer_version - version`` over the batch's trained tokens (``token_versions``
    ``[N, L]``, ``loss_mask`` ``[N, L]``); None without versions. The whole batch, not a DP slice: every
    DP rank must reach the same decision."""
    versions = batch.get("token_versions")
    if versions is None or trainer_version is None:
        return None
    valid = (batch["loss_mask"] > 0) & (versions >= 0)
    if not bool(valid.any()):
        return None
    return trainer_version - int(versions[valid].min())


def lag0_mask(batch: Mapping[str, torch.Tensor], trainer_version: int | None) -> torch.Tensor | None:
    """``[N, L]`` bool: the trained tokens sampled with the weights about to be trained (lag 0), from
    ``token_versions``; None without versions (every token then counts as lag 0, as ACRL's
    controller measures a batch without versions)."""
    versions = batch.get("token_versions")
    if versions is None or trainer_version is None:
        return None
    return (batch["loss_mask"] > 0) & (versions == trainer_version)
