"""What an adapter push sends (:mod:`megatron_acrl.servers.lora_sync`): the adapter packed in one
buffer, as a PEFT directory (``/load_lora_adapter``, servers on this host) or a ``flattened_bucket``
payload (``/load_lora_adapter_from_tensors``, any host).

Why two ways (measured, ``benchmarks/lora_sync.py``, 129 MB model, rank 16, 112 tensors, 3.5 MB
bf16): SGLang's tensor endpoint takes a JSON body, so the bytes travel as base64 (4.7 MB) and the
server's HTTP layer spends ~35 ms on such a body before the load starts; a plain pickle of the
tensors adds a nested ``torch.load`` per tensor on the server (24-30 ms), which the flattened bucket
(one storage) cuts to 2-3 ms. A server on this host reads a PEFT file from tmpfs instead: 5 ms to
write it, 18-21 ms for the whole ``/load_lora_adapter`` call.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor


def serialize(adapter: Mapping[str, Tensor], dtype: torch.dtype) -> str:
    """A ``load_format: null`` payload of ``/load_lora_adapter_from_tensors``: a plain pickle of
    ``{name: CPU tensor}`` in ``dtype``, base64. Kept for comparison (``benchmarks/lora_sync.py``):
    every tensor's storage is its own nested ``torch.load`` on the server (24-30 ms for 112 tensors,
    measured); a push sends :func:`flat_payload` instead."""
    tensors = {n: t.detach().to("cpu", dtype).contiguous() for n, t in adapter.items()}
    buf = io.BytesIO()
    pickle.dump(tensors, buf)  # the default protocol: what SGLang's safe unpickler was measured with
    return base64.b64encode(buf.getvalue()).decode("ascii")


@dataclass(frozen=True)
class Packed:
    """An adapter in one contiguous buffer: ``flat`` ``[sum numel]`` in the servers' dtype, and each
    tensor's ``(name, shape, start, end)`` in elements of ``flat``."""

    flat: Tensor
    spans: tuple[tuple[str, tuple[int, ...], int, int], ...]

    def tensors(self) -> dict[str, Tensor]:
        """``{name: view of flat}`` (no copy)."""
        return {n: self.flat[a:b].view(shape) for n, shape, a, b in self.spans}


def pack(adapter: Mapping[str, Tensor], dtype: torch.dtype) -> Packed:
    """Copy (and cast) every tensor of ``adapter`` into one ``dtype`` buffer, in the adapter's order."""
    total = sum(t.numel() for t in adapter.values())
    flat = torch.empty(total, dtype=dtype)
    spans, off = [], 0
    for name, t in adapter.items():
        n = t.numel()
        flat[off : off + n].view(t.shape).copy_(t.detach())
        spans.append((name, tuple(t.shape), off, off + n))
        off += n
    return Packed(flat, tuple(spans))


def all_finite(flat: Tensor) -> bool:
    """Whether every value of ``flat`` is finite: for 16-bit floats from the exponent bits of an
    integer view (a bf16 ``isfinite`` on CPU is ~8x slower: 13 ms for 1.8 M values, measured)."""
    if flat.dtype == torch.bfloat16:
        return not bool(((flat.view(torch.int16) & 0x7F80) == 0x7F80).any())
    if flat.dtype == torch.float16:
        return not bool(((flat.view(torch.int16) & 0x7C00) == 0x7C00).any())
    return bool(torch.isfinite(flat).all())


def flat_payload(packed: Packed) -> str:
    """A ``load_format: flattened_bucket`` payload: one pickle of ``{"flattened_tensor": uint8 bytes,
    "metadata": [...]}`` in base64: one tensor storage for the server to load instead of one per
    tensor. The metadata entries are ``types.SimpleNamespace`` (in SGLang's safe-unpickler allow
    list) with the fields SGLang's ``FlattenedTensorBucket.reconstruct_tensors`` reads (byte offsets),
    so the trainer need not import SGLang (4 s) to build them."""
    size = packed.flat.element_size()
    meta = [
        types.SimpleNamespace(
            name=n,
            shape=torch.Size(shape),
            dtype=packed.flat.dtype,
            start_idx=a * size,
            end_idx=b * size,
            numel=(b - a) * size,
        )
        for n, shape, a, b in packed.spans
    ]
    buf = io.BytesIO()
    pickle.dump({"flattened_tensor": packed.flat.view(torch.uint8), "metadata": meta}, buf)
    return _b64(buf.getvalue())


def _b64(data: bytes) -> str:
    try:  # SGLang's own dependency: 8x the stdlib's speed (0.7 vs 6 ms for 3.5 MB, measured)
        import pybase64

        return pybase64.b64encode(data).decode("ascii")
    except ImportError:  # pragma: no cover - the venv has it
        return base64.b64encode(data).decode("ascii")


def write_peft_dir(packed: Packed, config: dict[str, Any], path: Path) -> None:
    """Write ``packed`` as a PEFT adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``) at ``path``: what ``/load_lora_adapter`` reads."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(packed.tensors(), str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config))


Transport = Literal["auto", "disk", "tensors"]
