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
