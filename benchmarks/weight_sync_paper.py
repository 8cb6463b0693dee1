"""On paper: the bytes of one weight sync per source for our GPU configs, and the seconds they imply.

    python benchmarks/weight_sync_paper.py [--config configs/qwen3-30b-a3b.yaml ...]

For each model and layout (Qwen2.5-7B and Qwen3-30B-A3B from ``configs/``, a Qwen3-235B-A22B-sized
MoE at PP=4 x EP=8), the HF tensors every source sends -- stage s's (DP 0, TP 0) rank its stage's
dense tensors (the embeddings on the first stage, the final norm and LM head on the last), each EP
rank its own experts -- counted from the model's shapes, as the rollout quantizes them (FP8 block
128x128: e4m3 + fp32 scales for decoder projections, bf16 for the rest) and in bf16. Prints a
markdown table: the model's bytes per sync (every server rank receives all of them, whatever the
sources), the bytes through rank 0 on the rank-0 path (it sends the model and first receives the
other stages' and EP ranks' tensors), the busiest source's bytes, and seconds at 25 / 50 / 400 GB/s.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from pathlib import Path

from megatron_acrl.config import Config, ModelConfig, ParallelConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("configs/qwen2.5-7b-gsm8k.yaml", "configs/qwen3-30b-a3b.yaml")
BANDWIDTHS = (25e9, 50e9, 400e9)
QWEN3_235B = ModelConfig(
    family="qwen3_moe",
    num_layers=94,
    hidden_size=4096,
    ffn_hidden_size=12288,
    num_attention_heads=64,
    num_query_groups=4,
    kv_channels=128,
    qk_layernorm=True,
    add_qkv_bias=False,
    tie_embeddings=False,
    vocab_size=151936,
    max_position_embeddings=40960,
    num_experts=128,
    moe_router_topk=8,
    moe_ffn_hidden_size=1536,
)


def _weight(rows: int, cols: int, fp8: bool) -> int:
    """Bytes of one decoder projection on the wire: e4m3 + 128x128 fp32 scales, or bf16."""
    if not fp8:
        return 2 * rows * cols
    return rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)


def layer_parts(m: ModelConfig, fp8: bool) -> tuple[int, int]:
    """(dense bytes, bytes of ONE expert) of one decoder layer on the wire."""
    hd = m.kv_channels or m.hidden_size // m.num_attention_heads
    q, kv = m.num_attention_heads * hd, m.num_query_groups * hd
    dense = (
        _weight(q, m.hidden_size, fp8) + 2 * _weight(kv, m.hidden_size, fp8) + _weight(m.hidden_size, q, fp8)
    )
    dense += (
        2 * 2 * m.hidden_size
        + (2 * 2 * hd if m.qk_layernorm else 0)
        + (2 * (q + 2 * kv) if m.add_qkv_bias else 0)
    )
    if not m.num_experts:
        return dense + 3 * _weight(m.ffn_hidden_size, m.hidden_size, fp8), 0
    dense += 2 * m.num_experts * m.hidden_size  # the router stays bf16
    return dense, 3 * _weight(m.moe_ffn_hidden_size, m.hidden_size, fp8)


def source_bytes(m: ModelConfig, p: ParallelConfig, fp8: bool) -> list[int]:
    """Bytes each of the ``pp x ep`` sources sends (index stage * ep + EP rank)."""
    dense, expert = layer_parts(m, fp8)
    per_stage = m.num_layers // p.pp
    ep = p.ep if m.num_experts else 1
    vocab = 2 * m.vocab_size * m.hidden_size
    out = []
    for stage in range(p.pp):
        for e in range(ep):
            b = per_stage * expert * (m.num_experts // ep if m.num_experts else 0)
            if e == 0:
                b += per_stage * dense + (vocab if stage == 0 else 0)
                b += (2 * m.hidden_size + (0 if m.tie_embeddings else vocab)) if stage == p.pp - 1 else 0
            out.append(b)
    return out


def rows(cases: list[tuple[str, ModelConfig, ParallelConfig]]) -> Iterator[str]:
    yield (
        "| model | layout (sources) | rollout | model bytes / sync | rank-0 path: through rank 0 "
        "| per-source: busiest source | seconds at 25 / 50 / 400 GB/s: rank 0 | busiest source "
        "| each server rank (the floor) |"
    )
    yield "|---|---|---|---|---|---|---|---|---|"
    for name, m, p in cases:
        for fp8 in (True, False):
            src = source_bytes(m, p, fp8)
            model, busiest = sum(src), max(src)
            rank0 = model + (model - src[0])
            secs = [" / ".join(f"{b / bw:.2f}" for bw in BANDWIDTHS) for b in (rank0, busiest, model)]
            yield (
                f"| {name} | TP={p.tp} PP={p.pp} EP={p.ep} ({len(src)}) | {'FP8 block' if fp8 else 'bf16'} "
                f"| {model / 1e9:.1f} GB | {rank0 / 1e9:.1f} GB | {busiest / 1e9:.2f} GB "
                f"| {secs[0]} | {secs[1]} | {secs[2]} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", default=None, help="a training config (repeatable)")
    args = ap.parse_args()
    cases = []
    for path in args.config or CONFIGS:
        cfg: Config = load_config(ROOT / path if not Path(path).is_absolute() else path)
        cases.append((cfg.model.hf_path and Path(cfg.model.hf_path).name or path, cfg.model, cfg.parallel))
    cases.append(
        (
            "Qwen3-235B-A22B (shape)",
            QWEN3_235B,
            ParallelConfig(tp=4, pp=4, ep=8, sequence_parallel=True),
        )
    )
    for line in rows(cases):
        print(line)


if __name__ == "__main__":
    main()
