"""What a generation request asks for and what comes back: :class:`SamplingParams`, :class:`Sample`
and the decoding of the routed experts SGLang returns (MoE routing replay, R3)."""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from sglang_bridge.transport import SGLangHTTPError


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (SGLang ``sampling_params``)."""

    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    """Per-request sampling seed (``sampling_seed``); None lets the server draw."""
    lora_path: str | None = None
    """The loaded LoRA adapter to sample with (SGLang's request-level ``lora_path``, a name given to
    ``/load_lora_adapter_from_tensors``); None: the base weights. Not a ``sampling_params`` field."""

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            d["sampling_seed"] = self.seed
        return d


@dataclass
class Sample:
    """One generated continuation of a prompt."""

    prompt_ids: list[int]
    output_ids: list[int]
    rollout_logprobs: list[float]
    """Rollout log-prob (log mu) of each output token, ``len == len(output_ids)``, at
    ``logprob_temperature``."""
    finish_reason: str
    """"stop" (EOS / stop token), "length" (max_new_tokens) or "abort"."""
    weight_version: str
    """Weight version reported when the request finished."""
    weight_versions: list[dict[str, Any]] = field(default_factory=list)
    """Segments ``{"version", "start", "end"}`` over output tokens; a request paused across an update
    spans two."""
    logprob_temperature: float = 1.0
    """Temperature the log-probs are computed at (see :mod:`sglang_bridge.client`)."""
    server: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    routed_experts: np.ndarray | None = None
    """MoE routing of positions ``0 .. len(prompt_ids) + len(output_ids) - 2``: int32 ``[P + O - 1,
    num_layers, top_k]`` (None unless requested; see :mod:`sglang_bridge.client`)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decode_routed_experts(encoded: str, num_positions: int, topk: int) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]`` -> int32 ``[num_positions, num_layers, topk]``.

    Raises ``ValueError`` when the payload does not hold ``num_positions`` rows of a whole number of
    layers (a request sent with a nonzero ``routed_experts_start_len``, or a wrong ``topk``).
    """
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    per_row = topk * num_positions
    if num_positions <= 0 or flat.size % per_row:
        raise ValueError(
            f"routed_experts holds {flat.size} int32 values, not num_positions={num_positions} x "
            f"num_layers x top_k={topk}"
        )
    return flat.reshape(num_positions, flat.size // per_row, topk).copy()


def target_logprobs(out: dict[str, Any], seq: list[int], k: int, url: str) -> list[float]:
    """The last ``k`` entries of one scoring answer's ``input_token_logprobs`` (``[logprob, token,
    text]`` each), checked against the sequence's own tokens.

    SGLang 0.5.23 echoes the last vocabulary id (``vocab_size - 1``) as token 0 in this list
    (``scheduler_components/logprob_result_processor.py``: ``x if x < vocab_size - 1 else 0``, meant
    for image-hash ids) while its log-prob is that of the real token. Input ids >= ``vocab_size`` are
    refused at the door, so the only id echoed as 0 besides 0 itself is the largest one the vocabulary
    has: an echo of 0 is accepted only where the sequence holds its largest id. A shifted or truncated
    answer still fails (its echoes differ elsewhere)."""
    entries = (out.get("meta_info") or {}).get("input_token_logprobs") or []
    tail = entries[-k:]
    top = max(seq)
    ok = len(tail) == k and all(
        e[0] is not None and (int(e[1]) == t or (int(e[1]) == 0 and t == top))
        for e, t in zip(tail, seq[-k:], strict=True)
    )
    if not ok:
        raise SGLangHTTPError(
            url, "/generate", 200, f"scoring answered {entries!r:.200} for the last {k} tokens of {seq}"
        )
    return [float(e[0]) for e in tail]
