"""Helpers of the bridge tests: an independent transformers reference for log-probs."""

from __future__ import annotations

from pathlib import Path

import torch

from sglang_bridge.weight_sync import Manifest

PROMPTS = [[5, 17, 42, 99, 7, 120, 33], [3, 1, 4, 1, 5, 9, 2, 6], [200, 201, 202]]


def load_hf(
    path: Path, state_dict: dict[str, torch.Tensor] | None = None, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The checkpoint in transformers (optionally with other weights). fp32 compute on the bf16 weights
    by default: the reference closest to exact, so the tolerance is spent on SGLang's bf16 arithmetic."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.to(dtype)


def hf_named_tensors(model: torch.nn.Module, manifest: Manifest) -> dict[str, torch.Tensor]:
    """HF state dict as the server holds it: tied copies (lm_head.weight) dropped."""
    return {k: v for k, v in model.state_dict().items() if k not in manifest.tied}


@torch.no_grad()
def hf_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], outputs: list[list[int]], temperature: float
) -> list[list[float]]:
    """Per-output-token log softmax(logits / T) from an independent transformers forward."""
    res = []
    for p, o in zip(prompts, outputs, strict=True):
        ids = torch.tensor([p + o])
        logits = model(ids).logits[0].float() / temperature
        lp = torch.log_softmax(logits, -1)
        res.append([lp[len(p) - 1 + i, t].item() for i, t in enumerate(o)])
    return res
