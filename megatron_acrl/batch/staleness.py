"""Weight versions and staleness: the one place a server's version string becomes an integer.

A weight *version* is the number of RL steps (rollout batches trained on) the weights have seen: the
initial weights are version 0, the weights after step t's update are version t + 1, and the trainer
computes pi_old of step t on version t. The servers carry the version as the string ``step-<v>``
(:func:`format_version`), which SGLang reports back per request and per segment of output tokens;
:func:`parse_version` turns it into the integer of the rollout batch contract (``token_versions``).

The *lag* of a token trained at step t is ``t - version``; a sample's *staleness* is the lag of its
oldest token. :func:`staleness_metrics` reports both and splits the mismatch metrics of
:mod:`megatron_acrl.correction` by lag (lag 0 vs lag >= 1), computed with the same pure functions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from megatron_acrl.correction import MismatchTensors, finalize_metrics, mismatch_metrics

PREFIX = "step-"
_VERSION = re.compile(r"step-(\d+)")


def format_version(version: int) -> str:
    """The server-side string of ``version`` (``step-<v>``)."""
    if version < 0:
        raise ValueError(f"weight versions are >= 0, got {version}")
    return f"{PREFIX}{version}"


def parse_version(text: str) -> int:
    """``step-<v>`` -> v; anything else (a server that never received weights reports ``default``,
    an evaluation push ``step-<v>+unquantized``) is an error naming the string: training tokens are
    never sampled from weights outside the run's version sequence."""
    m = _VERSION.fullmatch(str(text))
    if m is None:
        raise ValueError(
            f"weight version {text!r} is not of the form {PREFIX}<int>: the token was not sampled from "
            "weights the trainer pushed in this run's version sequence"
        )
    return int(m.group(1))


def token_versions(num_tokens: int, final: str, segments: Sequence[Mapping[str, Any]] = ()) -> list[int]:
    """The version each of a sample's ``num_tokens`` output tokens was sampled with.

    ``segments`` are SGLang's ``meta_info["weight_versions"]``: ``{"version", "start", "end"}`` over
    output token indices, in order (a request paused across a weight update spans two); without them
    every token carries ``final`` (the version reported when the request finished). Segments must
    cover the tokens exactly once.
    """
    if not segments:
        return [parse_version(final)] * num_tokens
    out: list[int] = []
    for seg in segments:
        start, end = int(seg["start"]), int(seg["end"])
        if start != len(out) or end < start:
            raise ValueError(f"version segments {list(segments)} do not tile the output tokens in order")
        out.extend([parse_version(seg["version"])] * (end - start))
    if len(out) != num_tokens:
        raise ValueError(f"version segments cover {len(out)} tokens of a {num_tokens}-token output")
    return out


def lag_of_tokens(token_versions: Tensor, loss_mask: Tensor, trainer_version: int) -> Tensor:
    """``[N, L]`` int64 lag ``trainer_version - version`` of every trained token, -1 elsewhere.

    Raises ValueError for a token newer than the trainer's weights (versions from another run)."""
    valid = (loss_mask > 0) & (token_versions >= 0)
    lag = torch.where(valid, trainer_version - token_versions, torch.full_like(token_versions, -1))
    if bool((valid & (lag < 0)).any()):
        newest = int(token_versions[valid].max())
        raise ValueError(
            f"a token was sampled with weight version {newest}, newer than the trainer's {trainer_version}"
        )
    return lag


def staleness_metrics(
    token_versions: Tensor,
    loss_mask: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    trainer_version: int,
    *,
    max_lag_bins: int = 8,
) -> dict[str, float]:
    """What the drift of one rollout batch looks like to the step that trains on it.

    Args:
        token_versions: ``[N, L]`` int64 weight version of each response token (-1 elsewhere).
        loss_mask: ``[N, L]`` tokens that are trained. old_logprobs, rollout_logprobs: ``[N, L]``
            log pi_old (the trainer, at ``trainer_version``) and log mu (the sampler).
        trainer_version: the weights the step trains from.
        max_lag_bins: lags ``>= max_lag_bins - 1`` share the last ``lag_frac`` bin.
    Returns:
        ``async/staleness_mean`` / ``_max`` (per sample: the lag of its oldest trained token),
        ``async/token_lag_mean``, ``async/lag_frac/<k>`` (fraction of trained tokens with lag k, for
        every k up to the largest seen) and the mismatch metrics of
        :func:`~megatron_acrl.correction.mismatch_metrics` over the tokens of lag 0
        (``mismatch_lag0/*``) and of lag >= 1 (``mismatch_lag1plus/*``), each where it has tokens.
    """
    lag = lag_of_tokens(token_versions, loss_mask, trainer_version)
    valid = lag >= 0
    n_tok = int(valid.sum())
    if n_tok == 0:
        return {}
    seq_valid = valid.any(-1)
    per_seq = lag.amax(-1)[seq_valid].double()  # the oldest token: the largest lag
    out = {
        "async/staleness_mean": float(per_seq.mean()),
        "async/staleness_max": float(per_seq.max()),
        "async/token_lag_mean": float(lag[valid].double().mean()),
    }
    counts = torch.bincount(lag[valid].clamp(max=max_lag_bins - 1), minlength=1)
    for k, c in enumerate(counts.tolist()):
        out[f"async/lag_frac/{k}"] = c / n_tok
    for name, subset in (("mismatch_lag0/", valid & (lag == 0)), ("mismatch_lag1plus/", lag >= 1)):
        out.update(subset_mismatch(old_logprobs, rollout_logprobs, subset, name))
    return out


def subset_mismatch(
    old_logprobs: Tensor, rollout_logprobs: Tensor, subset: Tensor, prefix: str
) -> dict[str, float]:
    """:func:`~megatron_acrl.correction.mismatch_metrics` over the tokens of ``subset`` (``[N, L]``
    bool), named ``<prefix>*``; {} when it holds none."""
    if not bool(subset.any()):
        return {}
    sh = MismatchTensors(old_logprobs, rollout_logprobs, subset, fused=False)
    partial = mismatch_metrics(
        sh, num_tokens=int(subset.sum()), num_seqs=int(subset.any(-1).sum()), prefix=prefix
    )
    return finalize_metrics(partial)


def turn_metrics(
    turn_ids: Tensor,
    loss_mask: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    *,
    max_turn_bins: int = 8,
) -> dict[str, float]:
    """The mismatch split by agent turn: does the gap grow with the turn?

    Args:
        turn_ids: ``[N, L]`` int64 turn that generated each token (-1 off generated tokens).
        loss_mask: ``[N, L]`` tokens that are trained (generated tokens only: observations are 0).
        old_logprobs, rollout_logprobs: ``[N, L]`` log pi_old and log mu.
        max_turn_bins: turns ``>= max_turn_bins - 1`` share the last bin.
    Returns:
        ``mismatch_turn/<k>/*``: :func:`~megatron_acrl.correction.mismatch_metrics` (token-mean
        log-ratio, k3, ...) over the trained tokens of turn k, for each turn with tokens; empty for a
        single-turn batch (every token in turn 0: the batch-wide ``mismatch/*`` already says it).
    """
    trained = (loss_mask > 0) & (turn_ids >= 0)
    turns = turn_ids.clamp(max=max_turn_bins - 1)
    if not bool(trained.any()) or int(turns[trained].max()) == 0:
        return {}
    out: dict[str, float] = {}
    for k in range(int(turns[trained].max()) + 1):
        out.update(
            subset_mismatch(old_logprobs, rollout_logprobs, trained & (turns == k), f"mismatch_turn/{k}/")
        )
    return out
