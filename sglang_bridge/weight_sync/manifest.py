"""What the servers hold: :class:`Manifest`, every served weight's name, shape and dtype, read from the
served checkpoint's safetensors headers, and the check of an update against it.

SGLang itself accepts unknown names (skipped), wrong shapes (CPU) and dtype casts silently, so this
check is the only guard; :class:`ManifestMismatchError` says what did not match.
"""

from __future__ import annotations

import difflib
import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sglang_bridge.weight_sync.interface import WeightSyncError

_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class ManifestMismatchError(WeightSyncError, ValueError):
    """Tensors to send do not match the served model; nothing was sent."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Manifest:
    """Name -> (shape, dtype) of every weight the served model loads, as the server holds it."""

    tensors: dict[str, TensorSpec]
    tied: dict[str, str] = field(default_factory=dict)
    """Names the server does not load because they are tied to another (``lm_head.weight``)."""
    quantization_config: dict[str, Any] | None = None
    model_path: str = ""

    @classmethod
    def from_checkpoint(cls, model_path: str | Path, served_dtype: torch.dtype = torch.bfloat16) -> Manifest:
        """Read safetensors headers (no tensor data) and ``config.json`` of an HF checkpoint.

        Floating tensors are recorded in ``served_dtype`` (SGLang casts at load time to ``--dtype``),
        except FP8 weights and their fp32 scales, which the server keeps as they are.
        """
        path = Path(model_path)
        cfg = json.loads((path / "config.json").read_text())
        qc = cfg.get("quantization_config")
        tensors: dict[str, TensorSpec] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        for f in files:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                dt = _ST_DTYPES[info["dtype"]]
                is_scale = name.endswith(("weight_scale_inv", "weight_scale", "input_scale"))
                if (
                    dt.is_floating_point
                    and dt not in (torch.float8_e4m3fn, torch.float8_e5m2)
                    and not is_scale
                ):
                    dt = served_dtype
                tensors[name] = TensorSpec(tuple(info["shape"]), dt)
        tied = {}
        if cfg.get("tie_word_embeddings") and "lm_head.weight" not in tensors:
            tied["lm_head.weight"] = "model.embed_tokens.weight"
        return cls(tensors, tied, qc, str(path))

    def check(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> str | None:
        """None if ``(name, shape, dtype)`` matches, else a one-line reason."""
        spec = self.tensors.get(name)
        if spec is None:
            if name in self.tied:
                return (
                    f"{name}: tied to {self.tied[name]} in the served model (tie_word_embeddings); "
                    "SGLang would ignore it - send only the tied-to tensor"
                )
            near = difflib.get_close_matches(name, list(self.tensors), n=1, cutoff=0.6)
            return f"{name}: not a weight of the served model" + (
                f" (did you mean {near[0]}?)" if near else ""
            )
        if tuple(shape) != spec.shape:
            return f"{name}: shape {tuple(shape)} != served {spec.shape}"
        if dtype != spec.dtype:
            return f"{name}: dtype {dtype_str(dtype)} != served {dtype_str(spec.dtype)}"
        return None

    def validate(
        self, outs: Iterable[tuple[str, Sequence[int], torch.dtype]], *, require_complete: bool
    ) -> None:
        """Raise :class:`ManifestMismatchError` listing every tensor of ``outs`` (what will be sent,
        after the FP8 step) that would not match, sent twice, or (``require_complete``) missing."""
        self.validate_sources({"": outs}, require_complete=require_complete)

    def validate_sources(
        self,
        outs: Mapping[str, Iterable[tuple[str, Sequence[int], torch.dtype]]],
        *,
        require_complete: bool,
    ) -> None:
        """:meth:`validate` for an update several sources send together: ``outs`` maps each source's
        label (e.g. ``stage 1``) to what it will send. Every served weight must come exactly once,
        from whichever source; each problem names the source(s) it comes from."""
        errors: list[str] = []
        seen: dict[str, str] = {}
        for label, items in outs.items():
            where = f"{label}: " if label else ""
            for name, shape, dtype in items:
                if name in seen:
                    also = f" (also sent by {seen[name]})" if seen[name] != label else ""
                    errors.append(f"{where}{name}: sent twice{also}")
                seen.setdefault(name, label)
                if (err := self.check(name, shape, dtype)) is not None:
                    errors.append(where + err)
        if require_complete and not errors:
            missing = sorted(set(self.tensors) - set(seen))
            if missing:
                by = f" from any of {', '.join(outs)}" if len(outs) > 1 else ""
                errors.append(
                    f"{len(missing)} served weights not in the update{by} (a partial update would mix "
                    f"versions; pass require_complete=False for that): {missing[:5]}"
                )
        if errors:
            raise ManifestMismatchError(
                f"refusing weight update for {self.model_path or 'the served model'} "
                f"({len(errors)} problems, nothing sent):\n  " + "\n  ".join(errors[:20])
            )

    def __len__(self) -> int:
        return len(self.tensors)


def dtype_str(dt: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: SGLang's spelling of a dtype."""
    return str(dt).removeprefix("torch.")
