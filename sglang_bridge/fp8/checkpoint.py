"""The FP8 checkpoint a real FP8 server serves: an FP8 copy of the trainer's bf16 HF checkpoint
(:func:`write_fp8_checkpoint`), written once per scheme and reused (:func:`served_fp8_checkpoint`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

from sglang_bridge.fp8.quantize import quantize_named_tensors
from sglang_bridge.fp8.scheme import Fp8Scheme, fp8_quantization_config


def write_fp8_checkpoint(src: str | Path, dst: str | Path, scheme: Fp8Scheme) -> Path:
    """Write an FP8 copy of the bf16 HF checkpoint ``src`` to ``dst``; returns ``dst``.

    What a real FP8 server is started from (and what its weight-sync manifest is read from): every
    weight :func:`should_quantize` selects becomes e4m3 plus its scale (``weight_scale_inv`` for
    block scales, ``weight_scale`` otherwise), everything else is copied unchanged, and
    ``config.json`` gains :func:`fp8_quantization_config`. One safetensors file at a time (sharded
    checkpoints keep their shards; the index gains the scales). Files other than the weights
    (tokenizer, generation config) are copied. Writes into a temporary directory first, so an
    interrupted write never leaves a half-written checkpoint under ``dst``.
    """
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({cfg['quantization_config'].get('quant_method')})")
    # Several processes may write the same copy at once (each server task of a job, and the
    # trainer); each writes its own temporary directory, and the first to finish publishes it.
    tmp = dst.with_name(f"{dst.name}.partial-{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    index: dict[str, str] = {}
    for f in files:
        out = dict(quantize_named_tensors(load_file(str(f)).items(), scheme, mode="real"))
        save_file({k: v.contiguous() for k, v in out.items()}, str(tmp / f.name), metadata={"format": "pt"})
        index.update(dict.fromkeys(out, f.name))
    for other in src.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name != "config.json":
            shutil.copy2(other, tmp / other.name)
    cfg["quantization_config"] = fp8_quantization_config(scheme)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    idx = tmp / "model.safetensors.index.json"
    if idx.exists():
        meta = json.loads(idx.read_text())
        meta["weight_map"] = index
        idx.write_text(json.dumps(meta, indent=2))
    try:
        tmp.rename(dst)  # atomic; fails if another writer published dst first (or dst is in the way)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dst / "config.json").exists():
            raise
    return dst


def served_fp8_checkpoint(model_dir: str | Path, root: str | Path, scheme: Fp8Scheme) -> Path:
    """The checkpoint a real FP8 server serves for the bf16 ``model_dir``: ``model_dir`` itself if it
    is already FP8-serialized, else its FP8 copy under ``root`` in ``scheme`` (written by
    :func:`write_fp8_checkpoint` once, then reused; its name states the scheme, and a copy found
    there whose ``quantization_config`` is not ``scheme``'s is refused rather than served)."""
    model_dir = Path(model_dir)
    if json.loads((model_dir / "config.json").read_text()).get("quantization_config"):
        return model_dir
    tag = {"block": "block{}x{}".format(*scheme.block_size)}.get(scheme.granularity, scheme.granularity)
    tag += "-ue8m0" if scheme.ue8m0 else ""
    if scheme.ignored:  # which layers, not only how many: two lists of one length are two copies
        tag += "-ignore-" + hashlib.sha1("\n".join(sorted(scheme.ignored)).encode()).hexdigest()[:8]
    dst = Path(root) / f"{model_dir.name}-fp8-{tag}"
    if not (dst / "config.json").exists():
        return write_fp8_checkpoint(model_dir, dst, scheme)
    found = json.loads((dst / "config.json").read_text()).get("quantization_config")
    if found != fp8_quantization_config(scheme):
        raise ValueError(
            f"{dst} holds an FP8 copy with quantization_config {found}, not the rollout's "
            f"{fp8_quantization_config(scheme)}: delete it (it is rewritten from {model_dir})"
        )
    return dst
