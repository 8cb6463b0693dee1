"""The train batch: one typed dict from the rollout to the minibatches, and its one check.

A step's batch starts as :meth:`~megatron_acrl.batch.rollout_batch.RolloutBatch.tensors` (the
required keys) and is completed by ``Policy.prepare`` (pi_old, the reference, R2's routing, the
critic's values, advantages and returns); :func:`check_train_batch` then checks it once, before the
first minibatch. Every rank holds the whole batch. ``N`` = prompts x samples (grouped by prompt),
``L`` = the padded length (prompt + response, right-padded).

Alignment (docs/DESIGN.md, "Data contracts"): every ``[N, L]`` log-prob is float32 and position t
holds ``log p(token t | tokens < t)``; position 0 (no context) and right padding hold 0 in the
rollout's ``rollout_logprobs`` and are masked by ``loss_mask`` everywhere (the trainer's forward
passes leave the model's numbers there). Values are aligned the same way (``values[:, t]`` =
V(state before token t)). Routing is aligned with the *tokens*, not the log-probs: position p
holds the experts that routed token p, whose output predicted token p + 1.

===================  ====================  =======  ==================================================
key                  shape                 dtype    meaning
===================  ====================  =======  ==================================================
tokens               [N, L]                int64    prompt + response token ids, right-padded
loss_mask            [N, L]                float32  1 on response tokens the loss trains on, else 0
rollout_logprobs     [N, L]                float32  log mu: the rollout engine's log-probs
rewards              [N]                   float32  the sequence reward
group_ids            [N]                   int64    equal for the samples of one prompt
response_len         [N]                   int64    response tokens of each sample
routed_experts       [N, L, layers, k]     int16    MoE: the rollout's routing, -1 where none (R3)
token_versions       [N, L]                int64    weight version each response token was sampled
                                                    with, -1 on prompt and padding positions
turn_ids             [N, L]                int64    agent turn (0, 1, ...) that generated each token;
                                                    -1 on prompt, observation, boundary tokens and
                                                    padding (an observation belongs to no turn's
                                                    policy output; single-turn: 0 on the response)
old_logprobs         [N, L]                float32  log pi_old (the trainer, before the update)
recorded_experts     [N, L, stage's MoE    int16    R2: the pi_old pass's own routing, which the
                     layers, k]                     training pass replays
ref_logprobs         [N, L]                float32  the reference model's (``algorithm.kl_coef`` > 0)
values               [N, L]                float32  PPO: the critic's V(s_t) before the update
returns              [N, L]                float32  PPO: the critic's targets (GAE), 0 off the mask
advantages           [N, L]                float32  per-token advantages, 0 off the mask
===================  ====================  =======  ==================================================
"""

# No ``from __future__ import annotations`` here: TypedDict reads ``NotRequired`` from the evaluated
# annotations (stringified ones would make every key required on Python 3.11).
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NotRequired, TypedDict

import torch
from torch import Tensor

__all__ = ["TRAIN_BATCH_SPEC", "KeySpec", "TrainBatch", "TrainBatchError", "check_train_batch"]


class TrainBatch(TypedDict):
    """One step's batch; see the module doc for each key's shape, dtype and meaning."""

    tokens: Tensor
    loss_mask: Tensor
    rollout_logprobs: Tensor
    rewards: Tensor
    group_ids: Tensor
    response_len: Tensor
    routed_experts: NotRequired[Tensor]
    token_versions: NotRequired[Tensor]
    turn_ids: NotRequired[Tensor]
    old_logprobs: NotRequired[Tensor]
    recorded_experts: NotRequired[Tensor]
    ref_logprobs: NotRequired[Tensor]
    values: NotRequired[Tensor]
    returns: NotRequired[Tensor]
    advantages: NotRequired[Tensor]


@dataclass(frozen=True)
class KeySpec:
    """What :func:`check_train_batch` requires of one key.

    Attributes:
        dims: the shape's named leading dimensions (``"N"``, ``"L"``), then ``"*"`` for each free one.
        dtype: the one dtype the contract allows.
    """

    dims: tuple[str, ...]
    dtype: torch.dtype


_TOKEN_F32 = KeySpec(("N", "L"), torch.float32)
_ROUTING = KeySpec(("N", "L", "*", "*"), torch.int16)

TRAIN_BATCH_SPEC: dict[str, KeySpec] = {
    "tokens": KeySpec(("N", "L"), torch.int64),
    "loss_mask": _TOKEN_F32,
    "rollout_logprobs": _TOKEN_F32,
    "rewards": KeySpec(("N",), torch.float32),
    "group_ids": KeySpec(("N",), torch.int64),
    "response_len": KeySpec(("N",), torch.int64),
    "routed_experts": _ROUTING,
    "token_versions": KeySpec(("N", "L"), torch.int64),
    "turn_ids": KeySpec(("N", "L"), torch.int64),
    "old_logprobs": _TOKEN_F32,
    "recorded_experts": _ROUTING,
    "ref_logprobs": _TOKEN_F32,
    "values": _TOKEN_F32,
    "returns": _TOKEN_F32,
    "advantages": _TOKEN_F32,
}
"""Every key of :class:`TrainBatch` with its shape and dtype (the table in the module doc)."""


class TrainBatchError(ValueError):
    """A train batch that breaks the contract; the message names every offending key."""


def check_train_batch(tb: Mapping[str, object], need: Iterable[str] = ()) -> None:
    """Check ``tb`` against :data:`TRAIN_BATCH_SPEC` once: its keys, their shapes and dtypes.

    Args:
        tb: the train batch (see the module doc).
        need: optional keys this step must have as well (e.g. ``old_logprobs``, ``advantages``).
    Raises:
        TrainBatchError: listing every problem, each naming its key: a missing required or needed
            key, an unknown key (a misspelt one would otherwise be ignored), a value that is not a
            tensor, a wrong dtype, a wrong number of dimensions or a size that disagrees with
            ``tokens [N, L]``.
    """
    required = [k for k in TRAIN_BATCH_SPEC if k in TrainBatch.__required_keys__]
    problems = [f"{k}: missing" for k in [*required, *need] if k not in tb]
    problems += [f"{k}: not a train batch key" for k in tb if k not in TRAIN_BATCH_SPEC]
    tokens = tb.get("tokens")
    sizes = {}
    if isinstance(tokens, Tensor) and tokens.dim() == 2:  # else tokens' own entry says what is wrong
        sizes = {"N": tokens.shape[0], "L": tokens.shape[1]}
    for key, spec in TRAIN_BATCH_SPEC.items():
        if key in tb:
            problems += [f"{key}: {p}" for p in _key_problems(tb[key], spec, sizes)]
    if problems:
        raise TrainBatchError("train batch: " + "; ".join(dict.fromkeys(problems)))


def _key_problems(x: object, spec: KeySpec, sizes: dict[str, int]) -> list[str]:
    """What is wrong with one value ``x`` (empty: nothing); ``sizes`` holds N and L from ``tokens``."""
    if not isinstance(x, Tensor):
        return [f"{type(x).__name__}, not a tensor"]
    out = []
    if x.dtype != spec.dtype:
        out.append(f"dtype {x.dtype}, expected {spec.dtype}")
    want = "[" + ", ".join(spec.dims) + "]"
    if x.dim() != len(spec.dims):
        return [*out, f"shape {list(x.shape)}, expected {want}"]
    for i, name in enumerate(spec.dims):
        if name in sizes and x.shape[i] != sizes[name]:
            out.append(f"shape {list(x.shape)}, expected {want} with {name} = {sizes[name]} (from tokens)")
            break
    return out
