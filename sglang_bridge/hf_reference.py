"""An independent transformers forward as the reference for served log-probs (verify mode, tests,
``benchmarks/fp8_logprob_gap.py``).

    model = load_hf(ckpt, state_dict=trained, device="cuda")
    ref = hf_logprobs(model, prompt_ids, output_ids, temperature)   # per output token

fp32 compute on the bf16 weights by default: the reference closest to exact, so a comparison's
tolerance is spent on the server's arithmetic, not on the reference's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch


def load_hf(
    path: str | Path,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """The checkpoint at ``path`` in transformers, optionally with other weights (``state_dict``, HF
    names; a tied ``lm_head.weight`` may be missing), in ``dtype`` on ``device``, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(dict(state_dict), strict=False)
        if unexpected or not set(missing) <= {"lm_head.weight"}:
            raise ValueError(f"state_dict does not fit {path}: missing {missing}, unexpected {unexpected}")
    return model.to(device=device, dtype=dtype)


@torch.no_grad()
def hf_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    temperature: float,
) -> list[list[float]]:
    """``log softmax(logits / T)`` of each output token (one forward per prompt + output); a list of
    ``len(outputs[i])`` floats per sample."""
    device = next(model.parameters()).device
    res = []
    for p, o in zip(prompts, outputs, strict=True):
        ids = torch.tensor([list(p) + list(o)], device=device)
        lp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
        pos = torch.arange(len(p) - 1, len(p) - 1 + len(o), device=device)
        res.append(lp[pos, torch.tensor(list(o), dtype=torch.long, device=device)].tolist())
    return res


__all__ = ["hf_logprobs", "load_hf"]
