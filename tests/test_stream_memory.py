"""The weight-sync stream holds one tensor at a time: no stage of it (the cast to the served dtype,
the stress quantizer, the Megatron -> HF conversion) keeps the tensor it last handed on while the
next one is produced. A loop variable still bound there kept one more full tensor alive during the
next gather (``tests/test_weight_sync_layouts.py`` measures the memory; this is the cheap check)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator

import pytest
import torch

from megatron_acrl.config import Config
from megatron_acrl.megatron.convert import ArchInfo, iter_megatron_to_hf
from megatron_acrl.servers.transfer import weights_for_servers
from sglang_bridge.fp8 import Fp8Scheme
from sglang_bridge.fp8.stress import fake_quantize_named_stress

Stage = Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[tuple[str, torch.Tensor]]]


def _source(
    names: list[str], dtype: torch.dtype, alive: list[list[str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields a fresh [64, 64] tensor per name; before making each, records which earlier ones live."""
    refs: list[tuple[str, weakref.ref]] = []
    for name in names:
        alive.append([n for n, r in refs if r() is not None])
        t = torch.randn(64, 64).to(dtype)
        refs.append((name, weakref.ref(t)))
        yield name, t
        del t


def _arch() -> ArchInfo:
    return ArchInfo.from_model_config(Config().model)


STAGES: dict[str, Stage] = {
    "cast to the served dtype": lambda s: weights_for_servers(Config(), s, quantize=True),
    "stress quantizer": lambda s: fake_quantize_named_stress(s, Fp8Scheme("block", (32, 32))),
    "megatron -> hf": lambda s: iter_megatron_to_hf(iter(s), _arch()),
}
NAMES = {
    "cast to the served dtype": [f"model.layers.{i}.mlp.down_proj.weight" for i in range(3)],
    "stress quantizer": [f"model.layers.{i}.mlp.down_proj.weight" for i in range(3)],
    "megatron -> hf": ["decoder.final_layernorm.weight", "embedding.word_embeddings.weight"],
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_stage_of_the_stream_holds_nothing_between_tensors(stage: str) -> None:
    alive: list[list[str]] = []
    for name, t in STAGES[stage](_source(NAMES[stage], torch.float32, alive)):
        assert isinstance(name, str) and t.numel() > 0
        del t  # the consumer lets go, as the packer does
    assert all(a == [] for a in alive), alive
