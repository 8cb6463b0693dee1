"""What the rollout benchmarks share: a local model, servers pinned to cores, seeded prompts and
workloads, the CPU time of a server's process tree, and the median / alternating bookkeeping."""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import numpy as np
import psutil

from megatron_acrl.config import ModelConfig
from megatron_acrl.warmstart.tiny_model import build_checkpoint
from sglang_bridge.server import ServerSpec


def model_dir(work_dir: Path, layers: int, hidden: int) -> Path:
    """A bf16 HF checkpoint of the tiny family with ``layers`` x ``hidden`` (built once, cached)."""
    cfg = ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=2 * hidden,
        num_attention_heads=4,
        num_query_groups=2,
        max_position_embeddings=4096,
    )
    return build_checkpoint(cfg, seed=0, cache_dir=work_dir / "models")


def server_spec(ckpt: Path, cpus: tuple[int, ...] | None, max_total_tokens: int = 16384) -> ServerSpec:
    return ServerSpec(model_path=str(ckpt), device="cpu", cpus=cpus, max_total_tokens=max_total_tokens)


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def prompts(num: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``num`` random prompts of ``lo..hi`` tokens from ids ``3..vocab-1`` (seeded)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(num)]


def heavy_tailed_lengths(num: int, median: float, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    """Log-normal lengths (``median``, log-std ``sigma``) clipped to ``[lo, hi]``: a long right tail
    with a spike of sequences that hit the cap (seeded)."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, size=num)), lo, hi).astype(int).tolist()


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live children (a server's process tree)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def require_positive(ap: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Exit 2 (argparse's error) naming the first of ``names`` below 1."""
    for name in names:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
