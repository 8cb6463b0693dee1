"""The PPO critic: a Megatron-Core GPT model whose output layer is a scalar value head.

Same process groups and parallel layout as the policy :class:`~megatron_acrl.megatron.policy.Policy`
(TP / SP / PP / VPP / DP / EP and MoE), built and driven by the same
:class:`~megatron_acrl.megatron.base.ModelTrainer` machinery (DDP, optimizer, LR schedule,
micro-batching, pipeline schedule, HF weights, distributed checkpoints), and initialised from the
same HF weights (:meth:`Critic.load_hf`).

The value head (:class:`ValueHead`) replaces ``GPTModel.output_layer`` on the last pipeline stage:

* It is a *replicated* ``Linear(hidden, 1)``, identical on every TP rank, not a TP-sharded
  ``ColumnParallelLinear``: one output column cannot be split over TP ranks (a ColumnParallelLinear
  needs the output size divisible by TP; padding to TP columns would leave dead columns and need a
  broadcast of the live one), and the layer is only ``hidden`` numbers, so sharding saves nothing.
* Its input is the final-norm hidden state. Without sequence parallelism that is already the full
  ``[s, b, h]`` on every TP rank. With sequence parallelism each TP rank holds ``[s/tp, b, h]``; the
  head all-gathers it along the sequence with ``gather_from_sequence_parallel_region(...,
  tensor_parallel_output_grad=False)``. The computation after the gather is duplicated on every TP
  rank (same weights, same full sequence, same loss), so each rank already holds the *full* input
  gradient: the backward must only *split* it back to the rank's sequence slice, not reduce-scatter
  it (which would add tp identical copies). Megatron's own ColumnParallelLinear reduce-scatters
  because its rank-local output is a vocab shard, i.e. a partial input gradient.
* Its weight gradient is therefore identical on every TP rank and needs no TP all-reduce (it carries
  no ``sequence_parallel`` attribute, so ``finalize_model_grads`` leaves it alone); being marked
  neither ``tensor_model_parallel`` nor sequence-parallel, Megatron's grad-norm counts it once (TP
  rank 0 only). DP reduction is the usual DDP one.
* It computes in float32 (a ``[s, b, h] x [h]`` product, negligible) so bf16 models still give fp32
  values; the weight lives in the model's dtype like every other parameter.

The critic never ties its output to the embedding (it has no vocab projection): it is built with
``tie_embeddings=False`` whatever the policy does, so no embedding-group gradient sync is involved.
(The untied vocab projection GPTModel allocates is dropped before DDP wrapping.)

HF names: the backbone uses the policy's tables; the head is ``score.weight`` ``[1, hidden]`` as in
HF ``*ForTokenClassification`` with ``num_labels=1``. Loading a policy (causal-LM) checkpoint, which
has no ``score.weight``, initialises the head from ``N(0, init_method_std)`` with a generator seeded
by ``training.seed`` (same on every rank and every layout).

Value convention: ``values[:, t]`` = V(state before token t), computed from the hidden state at
position t - 1 (like log-probs: position t holds what predicts token t); ``values[:, 0] = 0``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_acrl.config import Config
from megatron_acrl.megatron.base import ModelTrainer
from megatron_acrl.megatron.checkpoint import save_step_atomically
from megatron_acrl.megatron.loss_adapter import LossFn, ValueLossAdapter
from megatron_acrl.megatron.model import build_model_chunks, unwrap

__all__ = ["HEAD_NAME", "HF_HEAD_NAME", "VALUE_KEYS", "Critic", "ValueHead"]

HEAD_NAME = "output_layer.score.weight"
"""Canonical Megatron name of the value-head weight (on the last pipeline stage)."""

HF_HEAD_NAME = "score.weight"
"""Its HF name (``*ForTokenClassification`` with ``num_labels=1``)."""

VALUE_KEYS = ("tokens", "loss_mask", "values", "returns")
"""Keys of a critic training batch, all ``[N, L]`` (``values``: the critic's values before the update)."""


class ValueHead(torch.nn.Module):
    """Drop-in for ``GPTModel.output_layer``: ``[s(/tp), b, h]`` hidden states -> ``([s, b, 1], None)``.

    Replicated over TP; gathers the sequence under sequence parallelism (see the module docstring).
    """

    def __init__(self, config: TransformerConfig, tp_group: torch.distributed.ProcessGroup) -> None:
        super().__init__()
        # Where Megatron puts its own parameters (DDP needs one device): the GPU unless CPU init.
        on_gpu = torch.cuda.is_available() and not config.use_cpu_initialization
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.score = torch.nn.Linear(
            config.hidden_size, 1, bias=False, dtype=config.params_dtype, device=device
        )
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel and tp_group.size() > 1

    def forward(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        """GPTModel's output-layer call signature; ``weight`` (tied embeddings) is never given."""
        del weight, runtime_gather_output
        if self.sequence_parallel:
            # Duplicated computation after the gather: backward splits, it must not reduce-scatter.
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
            )
        values = torch.nn.functional.linear(hidden_states.float(), self.score.weight.float())
        return values, None


class Critic(ModelTrainer):
    """Megatron-Core value model for PPO (see the module docstring for the head and conventions).

    Args:
        cfg: the run configuration (model, parallel layout, optimizer settings and
            ``algorithm.value_clip`` / ``value_coef`` are used).
        pg_collection: process groups; None reads Megatron's (``initialize_parallel`` first).
        total_steps: optimizer steps of the LR schedule (default as the policy's).
        loss_fn: the pure value loss (default ``megatron_acrl.algo.losses.value_loss``).
    """

    def __init__(
        self,
        cfg: Config,
        pg_collection: ProcessGroupCollection | None = None,
        *,
        total_steps: int | None = None,
        loss_fn: LossFn | None = None,
    ) -> None:
        super().__init__(cfg, pg_collection=pg_collection, total_steps=total_steps)
        a = cfg.algorithm
        self.adapter = ValueLossAdapter(clip=a.value_clip, coef=a.value_coef, loss_fn=loss_fn)

    def _build_chunks(self) -> list[torch.nn.Module]:
        untied = dataclasses.replace(self.cfg.model, tie_embeddings=False)
        chunks = build_model_chunks(untied, self.cfg.parallel, self.config, self.pg)
        for chunk in chunks:
            gpt = unwrap(chunk)
            if gpt.post_process:
                gpt.output_layer = ValueHead(self.config, self.pg.tp)
        return chunks

    # ----------------------------------------------------------------------------------------
    # Values and training
    # ----------------------------------------------------------------------------------------

    def forward_values(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Values of ``batch["tokens"] [N, L]`` under the current critic (forward-only schedule).

        Returns:
            ``{"values": [N, L] float32}`` on every rank; ``values[:, t]`` = V(state before token t),
            0 at t = 0 (padding positions hold the model's numbers and must be masked by the caller).
        """
        return self._forward_only(self.model, batch, self.adapter.forward_only_func, ["values"])

    def train_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step of the clipped value loss on ``batch`` (every rank holds all of it).

        Args:
            batch: ``tokens, loss_mask, values`` (old, from :meth:`forward_values`), ``returns``,
                all ``[N, L]``.
        Returns:
            Metrics, every key prefixed ``critic/`` (same on every rank): ``value_loss``,
            ``value_clipfrac``, ``vpred_mean``, ``grad_norm``, ``lr``, ``update_successful``.
        """
        missing = [k for k in VALUE_KEYS if k not in batch]
        if missing:
            raise KeyError(f"critic batch is missing {missing}")
        num_tokens = batch["loss_mask"].float().sum()
        micro, plan = self._micro_batches(batch, VALUE_KEYS)
        loss_func_for = partial(
            self.adapter.train_loss_func,
            num_tokens=num_tokens,
            num_microbatches=len(micro),
            dp_size=self.dp_size,
        )
        metrics = self._optimizer_step(micro, loss_func_for)
        metrics.update(plan.metrics())
        return {k if k.startswith("critic/") else f"critic/{k}": v for k, v in metrics.items()}

    # ----------------------------------------------------------------------------------------
    # Weights: the head's HF name and initialisation
    # ----------------------------------------------------------------------------------------

    def _to_hf(self, name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name == HEAD_NAME:
            return [(HF_HEAD_NAME, full)]
        return super()._to_hf(name, full)

    def _from_hf(self, name: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        if name != HEAD_NAME:
            return super()._from_hf(name, get)
        try:
            return get(HF_HEAD_NAME)
        except KeyError:  # a policy checkpoint: fresh head, identical on every rank and layout
            g = torch.Generator().manual_seed(self.cfg.training.seed)
            w = torch.empty(1, self.config.hidden_size, dtype=torch.float32)
            return w.normal_(0.0, self.config.init_method_std, generator=g)

    # ----------------------------------------------------------------------------------------
    # Checkpoints: a distributed checkpoint in the step directory's critic/
    # ----------------------------------------------------------------------------------------

    ckpt_kind = "critic"

    def _chunk_sharded_state_dict(self, chunk: torch.nn.Module, meta: dict[str, Any]) -> dict[str, Any]:
        """GPTModel's sharded state dict with the value head as a plain replicated tensor.

        On the last stage ``LanguageModule.sharded_state_dict`` post-processes the vocab projection
        ``output_layer.weight`` (padding tolerance), which the critic does not have (its head is
        ``output_layer.score.weight``: KeyError). With ``post_process`` off for the call that step
        is skipped; every child, the head included, is still collected by the generic
        ``MegatronModule`` walk, the head as a tensor replicated over TP and DP.
        """
        gpt = unwrap(chunk)
        post_process = gpt.post_process
        gpt.post_process = False
        try:
            return gpt.sharded_state_dict(metadata=meta)
        finally:
            gpt.post_process = post_process

    def save_checkpoint(self, directory: str | os.PathLike, step: int | None = None) -> Path:
        """Write ``directory/step_<n>/critic`` on its own and commit it (all ranks call it).

        ``n`` is ``step`` or the critic's own step. In a PPO run the driver instead passes
        ``lambda d: critic.save_dist(d / "critic")`` to ``Policy.save_checkpoint``, so policy,
        critic and driver state are committed together.
        """
        n = self.step if step is None else step
        return save_step_atomically(directory, n, [lambda d: self.save_dist(d / self.ckpt_kind)])

    def load_checkpoint(self, directory: str | os.PathLike, step: int | None = None) -> bool:
        """Load ``critic/`` of ``step_<step>`` or, by default, of the step ``latest.json`` names, under
        any layout. Returns False without ``latest.json``; raises FileNotFoundError if the checkpoint
        has no critic state (e.g. it was written by a GRPO run)."""
        return self._load_latest(directory, step)
