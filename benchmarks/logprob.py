"""Fused vocab-parallel log-prob vs the naive path, same run, same inputs.

    .venv/bin/python benchmarks/logprob.py [--tokens 2048] [--vocab 32768] [--tp 1] [--chunk N]
                                           [--threads N]

naive: gather the full logits over TP, cast to float32, log_softmax, gather the targets.
fused: ``megatron_acrl.megatron.logprobs.vocab_parallel_logprobs`` as the trainer calls it
(chunked, by default with the trainer's automatic chunk size; TP all-reduces, gradient written in
place). Intra-op threads per rank: ``--threads`` (default: cores / TP ranks).

Both run forward + backward (gradient w.r.t. the bf16 logits shard) on every TP rank (gloo
processes). Time: minimum over alternating repetitions in one process (machine load hits both
alike; the minimum is the estimate least disturbed by other processes). Peak *extra* memory: per
path in a fresh process; on CPU the resident-set high-water mark (VmHWM, reset once the inputs
exist and both paths are warmed up) minus the resident size at that point (large tensors are
mmap-backed, so freed memory leaves the RSS); on GPU
``torch.cuda.max_memory_allocated``. Ratios are rank 0's. The last two lines are
``memory ratio: <fused peak extra / logits shard bytes>`` and ``time ratio: <fused / naive>``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    """Reset the kernel's resident-set high-water mark (VmHWM) of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # fall back to the process-lifetime peak


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _inputs(args: argparse.Namespace, device: Any, rank: int) -> tuple[Any, Any, Any]:
    """This rank's bf16 logits shard ``[tokens, vocab / tp]``, the targets ``[tokens]`` (global
    vocabulary ids) and the upstream gradient ``[tokens]``."""
    import torch

    g = torch.Generator(device=device).manual_seed(1 + rank)
    shard = torch.empty(args.tokens, args.vocab // args.tp, dtype=torch.bfloat16, device=device)
    for lo in range(0, args.tokens, 64):  # no full-size float32 temporary before the baseline
        rows = shard[lo : lo + 64]
        rows.copy_(torch.randn(rows.shape, generator=g, device=device) * 3)
    target = torch.randint(0, args.vocab, (args.tokens,), generator=torch.Generator().manual_seed(0)).to(
        device
    )
    upstream = torch.randn(args.tokens, generator=torch.Generator().manual_seed(1)).to(device)
    return shard, target, upstream


def _paths(args: argparse.Namespace, target: Any, upstream: Any, group: Any) -> dict[str, Callable]:
    """``{"naive": fn, "fused": fn}``: forward + backward of one path on a logits leaf; each returns
    the detached log-probs ``[tokens]``."""
    import torch

    from megatron_acrl.megatron.logprobs import vocab_parallel_logprobs

    # Each call gets its own copy of the shard (made outside the measurement) playing the model's
    # output: the fused path overwrites it with its gradient, as in the trainer.
    def naive(leaf: torch.Tensor) -> torch.Tensor:
        full = leaf
        if args.tp > 1:  # all-gather with autograd: each rank keeps the gradient of its own shard
            from torch.distributed.nn.functional import all_gather

            full = torch.cat(all_gather(leaf, group=group), dim=-1)
        lp = torch.log_softmax(full.float(), dim=-1).gather(-1, target[:, None]).squeeze(-1)
        (lp * upstream).sum().backward()
        return lp.detach()

    def fused(leaf: torch.Tensor) -> torch.Tensor:
        lp, _ = vocab_parallel_logprobs(
            leaf, target, tp_group=group, chunk_size=args.chunk or None, inplace_backward=True
        )
        (lp * upstream).sum().backward()
        return lp.detach()

    return {"naive": naive, "fused": fused}


def _timed(args: argparse.Namespace, gpu: bool, fn: Callable, leaf: Any) -> tuple[float, Any]:
    """Seconds of ``fn`` on ``leaf`` (after a barrier over the TP ranks) and its output."""
    import torch
    import torch.distributed as dist

    if args.tp > 1:
        dist.barrier()
    t0 = time.perf_counter()
    out = fn(leaf.view_as(leaf))  # a non-leaf "model output" (autograd keeps its grad storage)
    if gpu:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def _time_report(args: argparse.Namespace, gpu: bool, paths: dict[str, Callable], fresh: Callable) -> dict:
    """Both paths in one process, alternating, so machine load hits them alike: minimum and
    median seconds of each, the thread count, checksums."""
    import torch

    times: dict[str, list[float]] = {"naive": [], "fused": []}
    checks = {}
    for _ in range(args.reps):
        for name in ("naive", "fused"):
            seconds, out = _timed(args, gpu, paths[name], fresh())
            times[name].append(seconds)
            checks[name] = float(out.double().sum())
    report: dict[str, Any] = {k: min(v) for k, v in times.items()}
    report["medians"] = {k: statistics.median(v) for k, v in times.items()}
    report["threads"] = torch.get_num_threads()
    report["checksums"] = checks
    return report


def _memory_report(args: argparse.Namespace, gpu: bool, fn: Callable, leaf: Any) -> dict:
    """Peak extra bytes of one path over the resident (CPU) / allocated (GPU) size before it."""
    import torch

    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
        _reset_peak_rss()
    _timed(args, gpu, fn, leaf)
    extra = (torch.cuda.max_memory_allocated() if gpu else _peak_rss_bytes()) - base
    return {"extra_bytes": extra, "shard_bytes": leaf.numel() * leaf.element_size()}


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from megatron_acrl.megatron.logprobs import auto_chunk_size, vocab_parallel_logprobs

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // args.tp))
    gpu = torch.cuda.is_available()
    if args.tp > 1:
        dist.init_process_group("nccl" if gpu else "gloo")
    rank = dist.get_rank() if args.tp > 1 else 0
    group = dist.group.WORLD if args.tp > 1 else None
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    shard, target, upstream = _inputs(args, device, rank)
    paths = _paths(args, target, upstream, group)

    small = shard[:8].detach().clone().requires_grad_(True)  # warm-up: lazy init outside the measurement
    vocab_parallel_logprobs(small, target[:8] % shard.shape[-1], tp_group=None)[0].sum().backward()
    torch.log_softmax(small.float(), -1).sum().backward()

    def fresh() -> torch.Tensor:
        return shard.detach().clone().requires_grad_(True)

    if args.path == "time":
        report = _time_report(args, gpu, paths, fresh)
        report["chunk"] = args.chunk or auto_chunk_size(shard.shape[-1], device)
    else:
        report = _memory_report(args, gpu, paths[args.path], fresh())
    if rank == 0:
        print(json.dumps(report))
    if args.tp > 1:
        dist.destroy_process_group()


def _measure(path: str, args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.tp):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(args.tp),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONWARNINGS="ignore",
        )
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--path",
            path,
            "--tokens",
            str(args.tokens),
            "--vocab",
            str(args.vocab),
            "--tp",
            str(args.tp),
            "--chunk",
            str(args.chunk),
            "--threads",
            str(args.threads),
            "--reps",
            str(args.reps),
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{path} worker failed")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens (rows of logits) per rank")
    ap.add_argument("--vocab", type=int, default=32768, help="full vocabulary (split over --tp ranks)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (gloo processes on CPU)")
    ap.add_argument("--chunk", type=int, default=0, help="tokens per chunk of the fused path (0: auto)")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: cores / tp)")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions of each path (minimum)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", choices=["naive", "fused", "time"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    naive, fused, timing = _measure("naive", args), _measure("fused", args), _measure("time", args)
    naive["seconds"], fused["seconds"] = timing["naive"], timing["fused"]
    shard = fused["shard_bytes"]
    check = timing["checksums"]
    rel = abs(check["fused"] - check["naive"]) / max(abs(check["naive"]), 1e-9)
    mib = 2**20
    print(
        f"logits shard: {args.tokens} x {args.vocab // args.tp} bf16 = {shard / mib:.1f} MiB, tp={args.tp}, "
        f"fused chunk={timing['chunk']} tokens, threads/rank={timing['threads']}"
    )
    for name, r in (("naive", naive), ("fused", fused)):
        print(
            f"{name}: peak extra {r['extra_bytes'] / mib:8.1f} MiB ({r['extra_bytes'] / shard:.2f}x shard), "
            f"fwd+bwd min {r['seconds'] * 1e3:8.1f} ms (median {timing['medians'][name] * 1e3:8.1f} ms)"
        )
    print(f"checksum agreement (sum of log-probs): rel diff {rel:.1e}")
    print(f"memory ratio: {fused['extra_bytes'] / shard:.3f}")
    print(f"time ratio: {fused['seconds'] / naive['seconds']:.3f}")


if __name__ == "__main__":
    main()
