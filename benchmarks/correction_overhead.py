"""Overhead of ACRL weights + every mismatch metric, relative to computing the tokens' log-probs.

Both sides are measured in the same run, interleaved, on the same tokens (8192 tokens, vocab
32768, float32, CPU by default):

- baseline: ``log_softmax(logits).gather(target)`` -- what any trainer pays to get log pi;
- ours: controller statistics + ACRL weights + all mismatch and weight metrics + the single host
  sync that turns them into floats.

The last line is ``overhead: <ours / baseline>`` (0.001 means 0.1%), from each side's minimum over
the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _correction_pass import correction_pass

from megatron_acrl.config import CorrectionConfig
from megatron_acrl.correction import AcrlController, MismatchTensors, acrl_discrepancy_stats, fused_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    b, t = args.tokens // args.seq_len, args.seq_len
    logits = torch.randn(args.tokens, args.vocab, device=dev)
    target = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    old = -torch.rand(b, t, device=dev) * 3
    roll = old + 0.05 * torch.randn(b, t, device=dev)
    mask = torch.ones(b, t, dtype=torch.bool, device=dev)
    mask[:, : t // 8] = False  # prompt tokens
    adv = torch.randn(b, 1, device=dev).expand(b, t)
    cfg = CorrectionConfig(method="acrl", gamma=0.65)
    ctl = AcrlController(cfg)
    fused = fused_cpu.resolve_kernel(cfg.kernel, dev)
    ctl.update(acrl_discrepancy_stats(MismatchTensors(old, roll * 1.01, mask, fused=fused), cfg.distance))
    n_tok, n_seq = int(mask.sum()), b

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def baseline() -> None:
        lp = torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1))
        lp.sum().item()

    def ours() -> None:
        correction_pass(cfg, ctl, old, roll, mask, adv, n_tok, n_seq)

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up: allocator, thread pool
        baseline()
        ours()
    base_t, ours_t = [], []
    for _ in range(args.repeats):
        base_t.append(timed(baseline))
        # The correction part is tiny; time 5 calls per sample (their mean) so timer resolution
        # does not dominate.
        ours_t.append(timed(lambda: [ours() for _ in range(5)]) / 5)
    # The minimum over repeats estimates each side's cost without the time other processes steal
    # on a shared machine (both sides are deterministic work); the medians are printed for context.
    base, mine = min(base_t), min(ours_t)
    print(f"tokens: {args.tokens}  vocab: {args.vocab}  device: {dev}  threads: {torch.get_num_threads()}")
    print(f"log-prob from logits: min {base * 1e3:.2f} ms  median {statistics.median(base_t) * 1e3:.2f} ms")
    med = statistics.median(ours_t)
    print(f"ACRL weights + all metrics: min {mine * 1e3:.3f} ms  median {med * 1e3:.3f} ms")
    print(f"overhead: {mine / base:.6f}")


if __name__ == "__main__":
    main()
