"""Weight-sync throughput of the bridge vs a raw transfer of the same bytes, on the same group, same run.

    python benchmarks/weight_sync.py [--layers 8 --hidden 768 --reps 3 --bucket-mb 512]

Starts one real SGLang server (CPU: bf16, so FP8 is fake-quant, block 128x128) on a locally built
model, connects a :class:`DistributedWeightSynchronizer`, and measures, alternating, best of ``reps``:

* raw:    the same bytes as one pre-flattened bucket: one ``/update_weights_from_distributed``
          request + one broadcast on the bridge's group (the least any transfer into the server costs:
          the server must join the broadcast and load what it received);
* bridge: ``sync()``: validation against the manifest, FP8 fake-quant, bucketing,
          pause -> flush -> begin -> buckets -> end -> version -> continue.

Also block-FP8 quantize throughput vs a plain copy of the same bytes. Prints
``quantize efficiency: <copy time / quantize time>`` and, last, ``sync efficiency: <raw / bridge>``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from megatron_acrl.config import ModelConfig
from megatron_acrl.tiny_model import build_checkpoint
from sglang_bridge.fp8 import Fp8Scheme, quantize_block, quantize_named_tensors, should_quantize
from sglang_bridge.server import ServerSpec, SGLangServer
from sglang_bridge.weight_sync import (
    DistributedWeightSynchronizer,
    Manifest,
    _Bucket,
    broadcast_async,
)


def load_named(path: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return {k: v.to(manifest.tensors[k].dtype) for k, v in out.items()}


def raw_transfer(sync: DistributedWeightSynchronizer, flat: _Bucket) -> float:
    """begin -> one request + one broadcast of pre-flattened bytes -> end; returns seconds.

    begin/end are part of the minimal protocol: without them SGLang 0.5.23 answers 400 and never
    joins the broadcast."""
    client = sync._clients[0]
    assert sync.group is not None
    t0 = time.perf_counter()
    sync._run(client.begin_weight_update())
    fut = sync._submit(
        client.update_weights_from_distributed(
            flat.names, flat.dtypes, flat.shapes, sync.group_name, load_format="flattened_bucket"
        )
    )
    work = broadcast_async(flat.flat, sync.group)
    while not work.is_completed():  # never wait blindly on a broadcast the server may not join
        if fut.done() and fut.exception() is not None:
            raise RuntimeError(f"server refused the raw transfer: {fut.exception()}")
        time.sleep(0.0005)
    r = fut.result()
    sync._run(client.end_weight_update())
    dt = time.perf_counter() - t0
    assert r.get("success"), r
    return dt


def bench_quantize(named: dict[str, torch.Tensor], scheme: Fp8Scheme, reps: int) -> tuple[float, float, int]:
    ws = [t for n, t in named.items() if should_quantize(n, t, scheme)]
    nbytes = sum(t.numel() * t.element_size() for t in ws)
    dst = [torch.empty_like(t) for t in ws]
    best_q = best_c = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for w in ws:
            quantize_block(w, scheme.block_size, ue8m0=scheme.ue8m0)
        best_q = min(best_q, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for d, w in zip(dst, ws, strict=True):
            d.copy_(w)
        best_c = min(best_c, time.perf_counter() - t0)
    return best_q, best_c, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--work-dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the server needs the other core; both paths run under the same limit
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-weight-sync-"))
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.hidden * 8 // 3 // 64 * 64,
        num_attention_heads=args.hidden // 64,
        num_query_groups=max(1, args.hidden // 128),
        vocab_size=args.vocab,
        tie_embeddings=False,
    )
    ckpt = build_checkpoint(cfg, cache_dir=work / "models")
    manifest = Manifest.from_checkpoint(ckpt)
    named = load_named(ckpt, manifest)
    scheme = Fp8Scheme("block", (128, 128))

    q_t, c_t, q_bytes = bench_quantize(named, scheme, args.reps)
    print(
        f"block-FP8 quantize: {q_bytes / 1e6:.1f} MB in {q_t:.3f}s ({q_bytes / q_t / 1e9:.2f} GB/s); "
        f"plain copy {c_t:.3f}s ({q_bytes / c_t / 1e9:.2f} GB/s)"
    )

    spec = ServerSpec(model_path=str(ckpt), device="cpu")
    with SGLangServer(spec, work / "sglang.log") as srv:
        sync = DistributedWeightSynchronizer(
            [srv.url], manifest, fp8=scheme, fp8_mode="fake", bucket_size_mb=args.bucket_mb, timeout_s=120
        )
        sync.connect()
        try:
            # The raw path sends exactly the bytes the bridge sends (fake-quant keeps names and dtypes).
            sent = list(quantize_named_tensors(named.items(), scheme, mode="fake"))
            nbytes = sum(t.numel() * t.element_size() for _, t in sent)
            flat = _Bucket(sent, torch.empty(nbytes, dtype=torch.uint8))
            sync.sync(named, version="warmup")
            raw_transfer(sync, flat)
            raw_best = bridge_best = float("inf")
            for i in range(args.reps):
                raw_best = min(raw_best, raw_transfer(sync, flat))
                rep = sync.sync(named, version=f"bench-{i}")
                bridge_best = min(bridge_best, rep.seconds)
                print(
                    f"rep {i}: raw {raw_best:.3f}s, bridge {rep.seconds:.3f}s {rep.num_buckets} buckets "
                    f"fp8={rep.fp8} " + " ".join(f"{k}={v:.3f}" for k, v in rep.timings.items())
                )
        finally:
            sync.close()
    print(f"model: {len(named)} tensors, {nbytes / 1e6:.1f} MB sent per sync, bucket {args.bucket_mb} MiB")
    print(f"raw transfer: {raw_best:.3f}s ({nbytes / raw_best / 1e9:.2f} GB/s)")
    print(f"bridge sync:  {bridge_best:.3f}s ({nbytes / bridge_best / 1e9:.2f} GB/s)")
    print(f"quantize efficiency: {c_t / q_t:.3f}")
    print(f"sync efficiency: {raw_best / bridge_best:.3f}")


if __name__ == "__main__":
    main()
