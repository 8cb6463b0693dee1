"""Adapter-only sync vs today's full sync, side by side on one real SGLang CPU server, same run.

    python benchmarks/lora_sync.py [--layers 8 --hidden 768 --vocab 8192 --rank 16 --reps 7] [--smoke]

Builds a dense model of ``--layers`` x ``--hidden`` locally (the way ``benchmarks/weight_sync.py``
does: ~129 MB bf16 at the defaults), starts one SGLang server on it with the LoRA engine
(``--enable-lora``, torch_native, every linear layer: q/k/v/o/gate/up/down, ``--max-lora-rank``
``--rank``) and measures, interleaved (the order flips every rep), median of ``--reps``:

* adapter: :meth:`megatron_acrl.servers.lora_sync.AdapterSync.push` of a rank-``--rank`` adapter
  on every linear layer (a new version each rep) as a run with servers on its own host does it:
  validation against the served model, packing into one bf16 buffer, a PEFT file on tmpfs,
  ``/load_lora_adapter``; the previous version is retired after the timing (off the sync's critical
  path, as in a run);
* adapter, any host: the same push with ``transport="tensors"`` (one ``flattened_bucket`` payload,
  ``/load_lora_adapter_from_tensors``): what servers on other hosts get (printed, not the goal);
* full: :meth:`sglang_bridge.weight_sync.DistributedWeightSynchronizer.sync` of every weight in bf16
  (today's path without FP8: the cheapest full sync, so the ratio is not flattered).

Bytes moved per push: the adapter's tensors in the servers' dtype (what SGLang loads) and what the
push writes (the PEFT file; a remote push sends base64, 4/3 larger, printed too), against the full
sync's broadcast bytes.

Then the other way of moving an adapter, the bridge's weight-update group: the same adapter (new
values) broadcast as one flattened bucket (``/update_weights_from_distributed``, between the
begin/end calls) under its PEFT names and under the bare HF names. SGLang 0.5.23 hands such a bucket
to the *base* model's ``load_weights`` (``model_runner_components/weight_updater.py``
``load_weights_from_distributed``), which skips names it has no parameter for (``qwen2.py``
``_legacy_load_weights``: ``if name not in params_dict: continue`` / "Parameter ... not found"),
while adapters live in the LoRA manager's own pool, filled only by ``/load_lora_adapter*``; stock
0.5.23 has no distributed adapter loader (``/load_lora_adapter_from_distributed`` is on the
sglang-miles branch only). The benchmark shows it: the server answers success, and the loaded
adapter's and the base's log-probs do not move (printed; "loads LoRA: no").

Prints the goal figures last: ``bytes moved per push adapter/full`` (goal <= 0.05 at rank 16) and
``sync time ratio adapter/full`` (goal <= 0.2).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: its sibling modules
import _weight_sync_layouts as layouts  # noqa: E402
from weight_sync import load_named, raw_transfer  # noqa: E402

from megatron_acrl.config.model import LoraConfig
from megatron_acrl.servers.lora_sync import (
    PEFT_PREFIX,
    AdapterSync,
    LoraManifest,
    adapter_config,
    served_modules,
)
from megatron_acrl.warmstart.tiny_model import build_checkpoint
from sglang_bridge.client import SGLangClient
from sglang_bridge.server import ServerGroup, ServerSpec
from sglang_bridge.server_spec import LoraServing
from sglang_bridge.weight_sync import DistributedWeightSynchronizer, Manifest
from sglang_bridge.weight_sync.buckets import Bucket

SMOKE = {"layers": 2, "hidden": 128, "vocab": 512, "reps": 2}
"""``--smoke``: a model of ~1 MB and two reps: checks the benchmark, not the goals."""


def make_adapter(lm: LoraManifest, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A rank-``rank`` PEFT adapter on every module of ``lm`` (random A and nonzero B), fp32 as
    a trainer holds it."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for mod, (o, i) in lm.modules.items():
        out[f"{PEFT_PREFIX}{mod}.lora_A.weight"] = torch.randn(rank, i, generator=g) * 0.05
        out[f"{PEFT_PREFIX}{mod}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.05
    return out


def score(url: str, seqs: list[list[int]], lora_path: str | None) -> torch.Tensor:
    """Teacher-forced log-probs of the last 8 tokens of each sequence, ``[len(seqs), 8]``."""

    async def run() -> list[list[float]]:
        async with SGLangClient(url, timeout_s=600) as c:
            return await c.score(seqs, [8] * len(seqs), lora_path=lora_path)

    return torch.tensor(asyncio.run(run()))


def update_group_check(
    sync: DistributedWeightSynchronizer,
    adapters: AdapterSync,
    url: str,
    adapter: dict[str, torch.Tensor],
    vocab: int,
) -> dict[str, float]:
    """Other values of the current adapter broadcast through the update group under its PEFT and
    bare HF names; then the same values loaded for real under another name. Returns max |dlogp| of
    the current adapter: run to run (``noise``), across the broadcast (``moved``), and to what the
    values serve when really loaded (``to_new``); the base's across the broadcast; the seconds."""
    seqs = [[(7 * i + 3 * j) % vocab for j in range(24)] for i in range(4)]
    name = adapters.current or ""
    before, base = score(url, seqs, name), score(url, seqs, None)
    noise = float((score(url, seqs, name) - before).abs().max())
    other = {n: -3.0 * t for n, t in adapter.items()}
    items = [(n, t.bfloat16()) for n, t in other.items()]
    items += [(n[len(PEFT_PREFIX) :], t) for n, t in items]
    nbytes = sum(t.numel() * t.element_size() for _, t in items)
    flat = Bucket(items, torch.empty(nbytes, dtype=torch.uint8))
    seconds = raw_transfer(sync, flat)  # asserts the server answered success
    after, base_after = score(url, seqs, name), score(url, seqs, None)
    adapters.push(other, "update-group-values")
    new = score(url, seqs, adapters.current)
    return {
        "seconds": seconds,
        "tensors": float(len(items)),
        "noise": noise,
        "moved": float((after - before).abs().max()),
        "to_new": float((after - new).abs().max()),
        "base_moved": float((base_after - base).abs().max()),
    }


def measure(args: argparse.Namespace, work: Path) -> list[str]:
    cfg = layouts.model_config(args, moe=False)
    ckpt = build_checkpoint(cfg, cache_dir=work / "models")
    manifest = Manifest.from_checkpoint(ckpt)
    named = load_named(ckpt, manifest)
    full_bytes = sum(t.numel() * t.element_size() for t in named.values())
    targets = served_modules(LoraConfig())
    lm = LoraManifest.from_manifest(manifest, targets, args.rank)
    lora = LoraServing(max_rank=args.rank, target_modules=targets, max_loras_per_batch=4)
    spec = ServerSpec(model_path=str(ckpt), device="cpu", lora=lora)
    size = f"{args.layers} layers x hidden {args.hidden}, vocab {args.vocab}"
    print(f"model: {size}: {full_bytes / 1e6:.1f} MB bf16")
    with ServerGroup([spec], log_dir=work / "logs", startup_timeout_s=900) as group:
        url = group.servers[0].url
        config = adapter_config(LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
        adapters = AdapterSync([url], lm, config, timeout_s=600, background=False)  # local: disk
        remote = AdapterSync([url], lm, config, timeout_s=600, background=False, transport="tensors")
        sync = DistributedWeightSynchronizer([url], manifest, timeout_s=600)
        sync.connect()
        try:
            first = adapters.push(make_adapter(lm, args.rank, 0), "step-0")  # warm every path
            remote.push(make_adapter(lm, args.rank, 0), "remote-0")
            warm = sync.sync(named, "full-0")
            assert warm.num_bytes == full_bytes, (warm.num_bytes, full_bytes)
            t_ad: list[float] = []
            t_rem: list[float] = []
            parts: dict[str, list[tuple[float, float, float]]] = {"disk": [], "tensors": []}
            t_full: list[float] = []
            order = ("adapter", "full", "tensors")
            for i in range(args.reps):
                adapter = make_adapter(lm, args.rank, i + 1)
                for which in order[i % 3 :] + order[: i % 3]:  # rotate: no path always runs first
                    if which == "full":
                        t_full.append(sync.sync(named, f"full-{i + 1}").seconds)
                        continue
                    ad, label = (
                        (adapters, f"step-{i + 1}") if which == "adapter" else (remote, f"remote-{i + 1}")
                    )
                    m = ad.push(adapter, label)
                    (t_ad if which == "adapter" else t_rem).append(m["sync/seconds"])
                    parts[ad.transport].append(
                        (m["sync/validate_s"], m["sync/serialize_s"], m["sync/post_s"])
                    )
                    ad.retire_now()  # off the critical path in a run
            rem_wire = remote.push(adapter, "remote-last")["sync/wire_bytes"]
            try:
                check = update_group_check(sync, adapters, url, adapter, args.vocab)
            except AssertionError as e:  # the server refused the bucket: it cannot load them either
                check = {}
                print(f"update group: the server refused the LoRA bucket: {e}")
        finally:
            sync.close()
            adapters.close()
            remote.close()
    ad_bytes, wire = first["sync/bytes"], first["sync/wire_bytes"]
    print(
        f"adapter push, servers on this host (rank {args.rank}, {int(first['sync/tensors'])} tensors, "
        f"PEFT file on tmpfs + /load_lora_adapter): median {median(t_ad):.4f}s of {args.reps} "
        f"[{' '.join(f'{x:.4f}' for x in t_ad)}]; {ad_bytes / 1e6:.2f} MB of tensors (bf16), "
        f"{wire / 1e6:.2f} MB written"
    )
    print(
        f"adapter push, any host (flattened_bucket /load_lora_adapter_from_tensors): median "
        f"{median(t_rem):.4f}s [{' '.join(f'{x:.4f}' for x in t_rem)}]; {rem_wire / 1e6:.2f} MB on the wire"
    )
    print(
        f"full sync (bf16): median {median(t_full):.4f}s of {args.reps} "
        f"[{' '.join(f'{x:.4f}' for x in t_full)}]; {full_bytes / 1e6:.1f} MB"
    )
    for how, rows in parts.items():
        v, z, p = (median(x[k] for x in rows) for k in range(3))
        print(
            f"adapter push ({how}) median parts: validate+pack {v:.4f}s, serialize {z:.4f}s, "
            f"POST + server load {p:.4f}s"
        )
    if check:
        loads = check["moved"] > 0.5 * check["to_new"]
        print(
            f"update group with {int(check['tensors'])} LoRA tensors (PEFT and bare HF names, "
            f"{check['seconds']:.4f}s): server answered success; the served adapter's log-probs moved "
            f"{check['moved']:.2e} (run-to-run {check['noise']:.2e}), the same values loaded for real "
            f"serve {check['to_new']:.2e} away; base moved {check['base_moved']:.2e}; "
            f"loads LoRA: {'yes' if loads else 'no'}"
        )
    print(f"sync time ratio adapter (any host, tensors)/full: {median(t_rem) / median(t_full):.4f}")
    ratios = [a / f for a, f in zip(t_ad, t_full, strict=True)]  # the same rep's pair
    print("per-rep adapter/full time: " + " ".join(f"{r:.3f}" for r in ratios))
    return [
        f"adapter tensor bytes / full bytes: {ad_bytes / full_bytes:.4f}",
        f"bytes moved per push adapter (any host)/full [rank {args.rank}]: {rem_wire / full_bytes:.4f}",
        f"bytes moved per push adapter/full [rank {args.rank}]: {wire / full_bytes:.4f}",
        f"sync time ratio adapter/full: {median(t_ad) / median(t_full):.4f}",
    ]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help=f"checks the benchmark, not the goals: {SMOKE}")
    ap.add_argument("--work-dir", default=None)
    args = ap.parse_args()
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    if args.rank < 1 or args.reps < 1:
        raise SystemExit(f"--rank {args.rank} / --reps {args.reps}: give values >= 1")
    return args


def main() -> None:
    args = parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-lora-sync-"))
    t0 = time.perf_counter()
    goals = measure(args, work)
    print(f"wall: {time.perf_counter() - t0:.0f}s")
    for line in goals:
        print(line)


if __name__ == "__main__":
    main()
