"""Verify mode, the same for every transport: sample fixed prompts on a server and compare its
per-token log-probs with the trainer's. A broken name mapping shows up as deltas of order 1."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sglang_bridge.samples import Sample, SamplingParams
from sglang_bridge.weight_sync.interface import ReferenceLogprobs, VerifyReport

log = logging.getLogger(__name__)


def verify_params(max_new_tokens: int, temperature: float) -> SamplingParams:
    """The sampling of a verify request: fixed length and seed, so a rerun compares the same tokens."""
    return SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, ignore_eos=True, seed=1234)


def compare_logprobs(samples: Sequence[Sample], reference: ReferenceLogprobs) -> VerifyReport:
    """|delta logp| of each sampled token between the server (``samples``, one per prompt) and
    ``reference(prompt_ids, output_ids, T)``, the trainer's log-probs at the temperature the server's
    are at: max / mean over all tokens and the max per prompt."""
    ref = reference(
        [s.prompt_ids for s in samples], [s.output_ids for s in samples], samples[0].logprob_temperature
    )
    deltas: list[float] = []
    per_prompt = []
    for s, r in zip(samples, ref, strict=True):
        if len(r) != len(s.rollout_logprobs):
            raise ValueError(f"reference returned {len(r)} log-probs for {len(s.rollout_logprobs)} tokens")
        d = [abs(a - b) for a, b in zip(s.rollout_logprobs, r, strict=True)]
        deltas += d
        per_prompt.append(max(d, default=0.0))
    rep = VerifyReport(
        samples[0].weight_version,
        max(deltas, default=0.0),
        sum(deltas) / max(len(deltas), 1),
        len(deltas),
        per_prompt,
    )
    log.info(
        "verify %s: max|dlogp|=%.4g mean=%.4g over %d tokens",
        rep.version,
        rep.max_abs_delta,
        rep.mean_abs_delta,
        rep.num_tokens,
    )
    return rep
