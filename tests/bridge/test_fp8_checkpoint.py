"""The FP8 checkpoint a real FP8 server serves (``write_fp8_checkpoint`` / ``served_fp8_checkpoint``).

A GPU server with real FP8 rollout serves an FP8 copy of the trainer's checkpoint, and the bridge
validates every sync against that copy's manifest. Checked here on CPU: the copy holds exactly what
the bridge sends in real mode (e4m3 + scales under the right names and shapes), its weights are the
FP8 rounding the CPU path fake-quantizes to, its ``quantization_config`` reads back as the same
scheme, and concurrent writers (each server task of a job, and the trainer) publish one copy.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sglang_bridge.fp8 import (
    FP8_DTYPE,
    Fp8Scheme,
    dequantize,
    fake_quantize,
    fp8_quantization_config,
    scheme_from_config,
    served_fp8_checkpoint,
    should_quantize,
    write_fp8_checkpoint,
)
from sglang_bridge.weight_sync import DistributedWeightSynchronizer, Manifest, ManifestMismatchError

SCHEMES = {
    "block128": Fp8Scheme("block", (128, 128)),
    "block32-ue8m0-ignore": Fp8Scheme(
        "block", (32, 32), ue8m0=True, ignored=("model.layers.0.mlp.down_proj",)
    ),
    "per_tensor": Fp8Scheme("per_tensor"),
    "per_channel": Fp8Scheme("per_channel"),
}


def _weights(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("scheme", list(SCHEMES.values()), ids=list(SCHEMES))
def test_fp8_copy_holds_what_the_bridge_sends(tiny_ckpt: Path, tmp_path: Path, scheme: Fp8Scheme) -> None:
    dst = write_fp8_checkpoint(tiny_ckpt, tmp_path / "fp8", scheme)
    src, out = _weights(tiny_ckpt), _weights(dst)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"] == fp8_quantization_config(scheme)
    back = scheme_from_config(cfg["quantization_config"])
    assert (back.granularity, back.ue8m0) == (scheme.granularity, scheme.ue8m0)
    if scheme.granularity == "block":
        assert back.block_size == scheme.block_size and back.ignored == scheme.ignored
    assert {p.name for p in tiny_ckpt.iterdir() if p.suffix != ".safetensors"} <= {
        p.name for p in dst.iterdir()
    }
    quantized = [n for n, t in src.items() if should_quantize(n, t, scheme)]
    assert quantized
    assert ("model.layers.0.mlp.down_proj.weight" in quantized) == (not scheme.ignored)  # ignored: bf16
    for name, t in src.items():
        if name not in quantized:
            assert torch.equal(out[name], t), name  # copied unchanged
            continue
        q, s = out[name], out[name[: -len("weight")] + scheme.scale_suffix]
        assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and q.shape == t.shape
        # The served weights are exactly the FP8 rounding the CPU path fake-quantizes to.
        assert torch.equal(dequantize(q, s, scheme, t.dtype), fake_quantize(t, scheme)), name
    # The manifest of the copy accepts the trainer's bf16 weights through a real-mode synchronizer
    # (which sends e4m3 + scales); the bf16 checkpoint's manifest, which a server quantizing online
    # would have been validated against, refuses them.
    named = [(n, t) for n, t in src.items() if n in Manifest.from_checkpoint(tiny_ckpt).tensors]
    meta = [(n, tuple(t.shape), t.dtype) for n, t in named]
    for manifest, ok in ((Manifest.from_checkpoint(dst), True), (Manifest.from_checkpoint(tiny_ckpt), False)):
        sync = DistributedWeightSynchronizer(["http://127.0.0.1:9"], manifest, fp8=scheme, fp8_mode="real")
        try:
            if ok:
                sync.validate(meta)
            else:
                with pytest.raises(ManifestMismatchError, match="float8_e4m3fn != served bfloat16"):
                    sync.validate(meta)
        finally:
            sync.close()


def test_served_copy_is_written_once_and_named_by_its_scheme(tiny_ckpt: Path, tmp_path: Path) -> None:
    scheme = SCHEMES["block128"]
    results: list[Path] = []
    errors: list[BaseException] = []

    def write() -> None:
        try:
            results.append(served_fp8_checkpoint(tiny_ckpt, tmp_path, scheme))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    # Concurrent writers (the server tasks of a job and the trainer) all get the one published copy.
    threads = [threading.Thread(target=write) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    dst = results[0]
    assert dst == tmp_path / f"{tiny_ckpt.name}-fp8-block128x128"
    assert sorted(p.name for p in tmp_path.iterdir()) == [dst.name]  # no partial directory left
    mtime = (dst / "config.json").stat().st_mtime_ns
    assert served_fp8_checkpoint(tiny_ckpt, tmp_path, scheme) == dst  # reused, not rewritten
    assert (dst / "config.json").stat().st_mtime_ns == mtime
    other = served_fp8_checkpoint(tiny_ckpt, tmp_path, Fp8Scheme("per_tensor", ue8m0=True))
    assert other.name == f"{tiny_ckpt.name}-fp8-per_tensor-ue8m0"
    # Ignored layers name the copy by which layers they are, so a different list is another copy.
    ignore_a = served_fp8_checkpoint(tiny_ckpt, tmp_path, Fp8Scheme("per_tensor", ignored=("layers.0.",)))
    ignore_b = served_fp8_checkpoint(tiny_ckpt, tmp_path, Fp8Scheme("per_tensor", ignored=("layers.1.",)))
    assert ignore_a != ignore_b
    # A copy under the expected name that holds another scheme is refused, not served.
    (other / "config.json").write_text(
        (dst / "config.json").read_text()  # block 128x128's quantization_config
    )
    with pytest.raises(ValueError, match="delete it"):
        served_fp8_checkpoint(tiny_ckpt, tmp_path, Fp8Scheme("per_tensor", ue8m0=True))
    # An FP8 checkpoint is served as it is; quantizing it again is refused.
    assert served_fp8_checkpoint(dst, tmp_path / "again", scheme) == dst
    with pytest.raises(ValueError, match="already quantized"):
        write_fp8_checkpoint(dst, tmp_path / "twice", scheme)
