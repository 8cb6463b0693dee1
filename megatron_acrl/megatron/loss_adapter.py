"""The one adapter between Megatron's pipeline schedule and the pure loss (``megatron_acrl.algo.losses``).

Megatron's contract (megatron-core 0.16, ``pipeline_parallel/schedules.py:forward_step_calc_loss``):
the last pipeline stage calls ``loss_func(output_tensor)``, which returns
``(loss, num_tokens, metrics)``; with ``config.calculate_per_token_loss=False`` the schedule then does
``loss /= clamp(num_tokens, 1); loss /= num_microbatches`` before backward, and DDP multiplies every
gradient by ``1 / dp_size`` while reducing (``average_in_collective=False``;
``distributed_data_parallel.py:281-288``, also for expert parameters).

The pure loss is different: it is already divided by the *global* denominators of the optimizer
step, so the sum over micro-batches and DP ranks is the full-batch loss. This adapter cancels
Megatron's three divisions exactly::

    returned_loss = loss * max(num_tokens_local, 1) * num_microbatches * dp_size

so gradients do not depend on micro-batching, DP size or PP size (proved by
``tests/test_megatron_layouts.py``). We keep ``calculate_per_token_loss=False`` on purpose: with it
the MoE auxiliary loss would be scaled by 1 per micro-batch and summed over DP (its scale is set by
the schedule, ``schedules.py:289-292``), i.e. it would grow with the number of micro-batches; in the
chosen mode Megatron averages it over micro-batches and DP ranks, which is its documented meaning.

Log-probs come from :func:`megatron_acrl.megatron.logprobs.vocab_parallel_logprobs`, aligned to the
batch contract: position t holds log p(token t | tokens < t); position 0 holds 0.

The PPO critic (:class:`ValueLossAdapter`) follows the same contract and the same scaling
(:func:`megatron_loss_scale`); its values are aligned like the log-probs: position t holds
V(state before token t), computed from the hidden state at position t-1; position 0 holds 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_acrl.algo.losses import PolicyLoss, RLLoss, value_loss
from megatron_acrl.config import AlgorithmConfig, CorrectionConfig
from megatron_acrl.correction import AcrlSignal, fused_cpu
from megatron_acrl.megatron.logprobs import vocab_parallel_logprobs

__all__ = [
    "LOSS_KEYS",
    "LossAdapter",
    "LossFn",
    "MicroBatch",
    "ValueLossAdapter",
    "megatron_loss_scale",
    "shift_right",
]

MicroBatch = dict[str, torch.Tensor]
"""One micro-batch: ``tokens [b, T]`` int64 and, for training, ``loss_mask``, ``old_logprobs``,
``rollout_logprobs``, ``advantages`` (and optionally ``ref_logprobs``), all ``[b, T]``."""

LOSS_KEYS = ("loss_mask", "old_logprobs", "rollout_logprobs", "advantages", "ref_logprobs", "turn_ids")
"""The micro-batch's ``[b, T]`` tensors a policy loss may read, handed to it as float32."""

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""Signature of the value loss, ``megatron_acrl.algo.losses.value_loss``."""


def megatron_loss_scale(
    mask: torch.Tensor, num_microbatches: int, dp_size: int
) -> tuple[torch.Tensor, float]:
    """``(n_local, undo)`` of one micro-batch with loss mask ``mask [b, T]``.

    ``n_local`` (int tensor) is the token count returned to the schedule; multiplying a pure loss
    (already divided by the step's global denominators) by ``undo = max(n_local, 1) *
    num_microbatches * dp_size`` exactly cancels the schedule's ``/ clamp(n_local, 1) /
    num_microbatches`` and DDP's ``1 / dp_size``.
    """
    n_local = mask.sum().to(torch.int)
    return n_local, float(max(int(n_local), 1) * num_microbatches * dp_size)


def shift_right(x: torch.Tensor) -> torch.Tensor:
    """``[b, T] -> [b, T]``: position t takes position t-1's value, position 0 holds 0.

    The model's output at position t-1 (it has seen tokens <= t-1) belongs to token t: the
    distribution that predicts it, or the value of the state it is chosen in.
    """
    return torch.cat([x.new_zeros(x.shape[0], 1), x[:, :-1]], dim=1)


class LossAdapter:
    """Turns vocab-parallel logits of one micro-batch into Megatron's (loss, num_tokens, metrics).

    Args:
        algorithm / correction: the settings of the default loss (:class:`~megatron_acrl.algo.losses.RLLoss`);
            ``correction.kernel`` and ``algorithm.entropy_coef`` are read here too.
        tp_group: tensor-parallel group of this rank (the logits are vocab-parallel over it).
        vocab_size: real vocabulary size (Megatron's padding rows are excluded from the softmax).
        temperature: rollout sampling temperature (log-probs are of ``softmax(logits / T)``).
        chunk_size: tokens per chunk of the fused log-prob (None: sized automatically).
        norm_len: constant length of ``seq-mean-token-sum-norm`` (Dr. GRPO); None uses the config.
        entropy: compute token entropies (needed for ``entropy_coef`` > 0; also logged).
        loss_fn: the pure loss with its settings bound (a
            :class:`~megatron_acrl.algo.losses.PolicyLoss`); default ``RLLoss(algorithm, correction,
            fused=..., norm_len=norm_len)``.
        device: where the trainer's tensors live; None: ``cuda`` when available, else ``cpu`` (as
            the trainer itself decides).

    Attributes:
        fused: ``correction.kernel`` resolved for ``device``, once, here
            (:func:`~megatron_acrl.correction.fused_cpu.resolve_kernel`): whether the correction
            runs the fused C pass. Bound into the default loss, and read by the policy for the
            controller's statistics.

    Raises:
        ValueError: ``correction.kernel=fused_cpu`` and the C library did not build or ``device``
            is not a CPU.
    """

    def __init__(
        self,
        *,
        algorithm: AlgorithmConfig,
        correction: CorrectionConfig,
        tp_group: dist.ProcessGroup | None,
        vocab_size: int,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        norm_len: int | None = None,
        entropy: bool = True,
        loss_fn: PolicyLoss | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.fused = fused_cpu.resolve_kernel(correction.kernel, device)
        self.tp_group = tp_group
        self.vocab_size = vocab_size
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.entropy = entropy or algorithm.entropy_coef > 0
        self.loss_fn: PolicyLoss = loss_fn or RLLoss(
            algorithm, correction, fused=self.fused, norm_len=norm_len
        )

    def token_logprobs(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        with_entropy: bool = False,
        inplace_backward: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Aligned per-token log-probs (and entropies) of ``tokens`` under ``logits``.

        Args:
            logits: ``[b, T, V_local]`` vocab-parallel logits (Megatron's GPTModel output).
            tokens: ``[b, T]`` int64.
        Returns:
            ``logprobs [b, T]`` float32 with ``[:, t] = log p(tokens[:, t] | tokens[:, :t])`` and 0 at
            t = 0; ``entropy [b, T]`` likewise aligned (entropy of the distribution that predicted
            token t) or None.
        """
        # Score every position against the *next* token (the last one against a dummy id 0)
        # instead of slicing logits[:, :-1]: the slice of a [b, T, V] tensor is not contiguous and
        # flattening it would copy the whole logits tensor.
        nxt = torch.roll(tokens, shifts=-1, dims=1)
        lp, ent = vocab_parallel_logprobs(
            logits,
            nxt,
            tp_group=self.tp_group,
            vocab_size=self.vocab_size,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            with_entropy=with_entropy,
            inplace_backward=inplace_backward,
        )
        return shift_right(lp), (shift_right(ent) if ent is not None else None)

    def train_loss_func(
        self,
        micro: MicroBatch,
        *,
        acrl: AcrlSignal | None,
        num_tokens: torch.Tensor,
        num_seqs: torch.Tensor,
        num_microbatches: int,
        dp_size: int,
        weight_mean: torch.Tensor | None = None,
    ) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
        """The ``loss_func`` Megatron's schedule calls on the last stage for ``micro``.

        Args:
            micro: this micro-batch (see :data:`MicroBatch`).
            acrl: controller signal of the current rollout batch (None unless method is acrl).
            num_tokens / num_seqs: global denominators of the whole optimizer step (its valid tokens:
                :func:`~megatron_acrl.correction.valid_mask`).
            num_microbatches: micro-batches per DP rank in this step (Megatron divides by it).
            dp_size: data-parallel size (DDP averages over it).
            weight_mean: ``correction.batch_normalize``: the step's mean weight
                (:func:`~megatron_acrl.correction.batch_weight_mean`), the same on every micro-batch.
        """
        fields = {k: micro[k].float() for k in LOSS_KEYS if k in micro}
        # Exactly cancels the schedule's "/ clamp(num_tokens, 1) / num_microbatches" and DDP's 1/dp.
        n_local, undo = megatron_loss_scale(fields["loss_mask"], num_microbatches, dp_size)

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
            # The logits feed nothing else: backward may overwrite them with their gradient.
            logp, ent = self.token_logprobs(
                logits, micro["tokens"], with_entropy=self.entropy, inplace_backward=True
            )
            loss, metrics = self.loss_fn(
                logp, fields, num_tokens, num_seqs, entropy=ent, acrl=acrl, weight_mean=weight_mean
            )
            return loss * undo, n_local, metrics

        return loss_func

    def forward_only_func(self, micro: MicroBatch, with_entropy: bool) -> Callable[..., dict[str, Any]]:
        """``loss_func`` for ``collect_non_loss_data=True``: returns aligned log-probs, no loss."""

        def collect(logits: torch.Tensor, non_loss_data: bool = True) -> dict[str, Any]:
            with torch.no_grad():
                lp, ent = self.token_logprobs(logits, micro["tokens"], with_entropy=with_entropy)
            return {"logprobs": lp, "entropy": ent}

        return collect


class ValueLossAdapter:
    """Turns the critic's per-position values of one micro-batch into Megatron's (loss, num_tokens,
    metrics), with the same scaling contract as :class:`LossAdapter`.

    The critic's model output is ``[b, T, 1]`` float32: position p holds the value of the state after
    tokens <= p. :meth:`token_values` aligns it to the batch contract (``values[:, t]`` = V(state
    before token t), 0 at t = 0), so GAE and the loss index values like log-probs.

    Args:
        clip: PPO value clip range (``algorithm.value_clip``).
        coef: weight of the value loss in the critic's objective (``algorithm.value_coef``); it scales
            the gradient (matters for gradient clipping and Adam's eps), metrics stay unscaled.
        loss_fn: the pure value loss; default ``megatron_acrl.algo.losses.value_loss``.
    """

    def __init__(self, *, clip: float, coef: float = 1.0, loss_fn: LossFn | None = None) -> None:
        self.clip = clip
        self.coef = coef
        self.loss_fn = loss_fn or value_loss

    @staticmethod
    def token_values(out: torch.Tensor) -> torch.Tensor:
        """``[b, T, 1]`` value-head output -> ``[b, T]`` float32 aligned values (0 at t = 0)."""
        return shift_right(out.squeeze(-1).float())

    def train_loss_func(
        self,
        micro: MicroBatch,
        *,
        num_tokens: torch.Tensor,
        num_microbatches: int,
        dp_size: int,
    ) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
        """The ``loss_func`` for ``micro`` (``tokens, loss_mask, values`` (old), ``returns``, ``[b, T]``).

        Args:
            num_tokens: valid tokens of the whole optimizer step (the global denominator).
            num_microbatches / dp_size: as in :meth:`LossAdapter.train_loss_func`.
        """
        mask = micro["loss_mask"].float()
        n_local, undo = megatron_loss_scale(mask, num_microbatches, dp_size)

        def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
            values = self.token_values(out)
            loss, metrics = self.loss_fn(
                values,
                micro["values"].float(),
                micro["returns"].float(),
                mask,
                clip=self.clip,
                num_tokens=num_tokens,
            )
            n_tok = torch.as_tensor(num_tokens, dtype=values.dtype).clamp_min(1)
            metrics["critic/vpred_mean"] = (values.detach() * mask).sum() / n_tok  # partial (SUM)
            return loss * (self.coef * undo), n_local, metrics

        return loss_func

    def forward_only_func(self, micro: MicroBatch) -> Callable[..., dict[str, Any]]:
        """``loss_func`` for ``collect_non_loss_data=True``: returns aligned values, no loss."""

        def collect(out: torch.Tensor, non_loss_data: bool = True) -> dict[str, Any]:
            with torch.no_grad():
                return {"values": self.token_values(out)}

        return collect
