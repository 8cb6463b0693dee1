"""Log-prob gap between the BF16 trainer and an FP8 rollout server on fixed prompts, as one script.

    python benchmarks/fp8_logprob_gap.py                 # a GPU: real FP8 served (e4m3, block 128x128)
    python benchmarks/fp8_logprob_gap.py --device cpu    # CPU: the same steps, FP8 as fake-quant

1. Builds a tiny Qwen2 model locally and its "trained" weights (the checkpoint plus a small
   perturbation: what a training step hands the bridge).
2. Starts two SGLang servers side by side: a BF16 one (the control: the server's own arithmetic
   only) and an FP8 one. On cuda the FP8 server serves the FP8 copy of the checkpoint
   (``served_fp8_checkpoint``: e4m3 + ``weight_scale_inv`` per 128x128 block) with SGLang's FP8
   GEMMs; on CPU, where SGLang cannot serve FP8, it is a bf16 server the bridge fake-quantizes into.
3. Pushes the trained weights into both through the bridge: real FP8 (e4m3 + scales, NCCL) on cuda,
   fake-quant over gloo on CPU.
4. ``verify``: samples on fixed prompts (temperature 1, seeded) and compares each server's per-token
   log-probs with the trainer's (a transformers forward of the trained weights, fp32 compute on the
   bf16 weights), after checking that every sample carries the trained weights' version.

Prints both servers' mean / max |delta logp| and, last, ``fp8 logprob gap: <mean |delta logp| of
the FP8 server>``. Needs SGLang (and on cuda its GPU kernels); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from megatron_acrl.config import ModelConfig
from megatron_acrl.warmstart.tiny_model import build_checkpoint
from sglang_bridge.fp8 import Fp8Scheme, served_fp8_checkpoint
from sglang_bridge.hf_reference import hf_logprobs, load_hf
from sglang_bridge.server import ServerGroup, ServerSpec
from sglang_bridge.weight_sync import DistributedWeightSynchronizer, Manifest, VerifyReport


def trained_weights(ckpt: Path, noise: float, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's weights plus ``noise`` x their std of Gaussian noise (bf16, HF names)."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            x = t.float()
            out[name] = (x + noise * x.std() * torch.randn(x.shape, generator=gen)).to(t.dtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--block", type=int, default=128, help="FP8 scale block (rows = cols)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--noise", type=float, default=0.05, help="perturbation of the trained weights (x std)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=None)
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="fp8-logprob-gap-"))
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=3 * args.hidden,
        num_attention_heads=max(1, args.hidden // 64),
        num_query_groups=max(1, args.hidden // 128),
        vocab_size=args.vocab,
        tie_embeddings=False,
    )
    ckpt = build_checkpoint(cfg, seed=args.seed, cache_dir=work / "models")
    scheme = Fp8Scheme("block", (args.block, args.block))
    fp8_mode = "real" if device == "cuda" else "fake"
    fp8_dir = served_fp8_checkpoint(ckpt, work / "served_fp8", scheme) if fp8_mode == "real" else ckpt
    trained = trained_weights(ckpt, args.noise, args.seed + 1)
    reference = load_hf(ckpt, state_dict=trained, device=device)
    gen = torch.Generator().manual_seed(args.seed + 2)
    # Token ids the locally trained tokenizer knows (it stays small; the embedding may be larger).
    prompts = torch.randint(3, min(args.vocab, 320), (args.prompts, args.prompt_len), generator=gen).tolist()

    # Both servers on one GPU: each takes a small share of its memory (the model is tiny).
    mem = 0.2 if device == "cuda" else None
    specs = [
        ServerSpec(model_path=str(ckpt), device=device, mem_fraction_static=mem),
        ServerSpec(model_path=str(fp8_dir), device=device, mem_fraction_static=mem),
    ]
    label = "real FP8" if fp8_mode == "real" else "fake-quant FP8 (bf16 server)"
    reports: dict[str, VerifyReport] = {}
    with ServerGroup(specs, work / "logs", startup_timeout_s=900) as group:
        for (name, fp8), url, served in zip(
            (("bf16", None), ("fp8", scheme)), group.urls, (ckpt, fp8_dir), strict=True
        ):
            manifest = Manifest.from_checkpoint(served)
            named = {k: v for k, v in trained.items() if k not in manifest.tied}
            with DistributedWeightSynchronizer(
                [url], manifest, device=device, fp8=fp8, fp8_mode=fp8_mode, timeout_s=600
            ) as sync:
                rep = sync.sync(named, version="trained")
                print(
                    f"{name} server: sync {rep.num_bytes / 1e6:.1f} MB in {rep.num_buckets} bucket(s), "
                    f"{rep.seconds:.3f}s, fp8={rep.fp8}"
                )
                reports[name] = sync.verify(
                    prompts,
                    lambda p, o, t: hf_logprobs(reference, p, o, t),
                    max_new_tokens=args.new_tokens,
                    temperature=1.0,
                )
            if reports[name].version != "trained":
                raise SystemExit(f"{name} server answered with weight version {reports[name].version!r}")
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; {args.prompts} prompts x "
        f"{args.new_tokens} sampled tokens at temperature 1; device {device}; FP8: {label}, "
        f"block {args.block}x{args.block}"
    )
    for name in ("bf16", "fp8"):
        r = reports[name]
        print(
            f"{name} server vs trainer: mean |dlogp| {r.mean_abs_delta:.4g}, max {r.max_abs_delta:.4g} "
            f"over {r.num_tokens} tokens"
        )
    print(f"bf16 logprob gap: {reports['bf16'].mean_abs_delta:.4g}")
    print(f"fp8 logprob gap (max): {reports['fp8'].max_abs_delta:.4g}")
    print(f"fp8 logprob gap: {reports['fp8'].mean_abs_delta:.4g}")


if __name__ == "__main__":
    main()
