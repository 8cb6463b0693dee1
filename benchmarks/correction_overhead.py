"""Overhead of ACRL weights + every mismatch metric, relative to computing the tokens' log-probs,
for both kernels of the correction (the PyTorch path, what runs on a GPU, and the fused C pass), on a
single-turn and on a multi-turn (agent) batch.

Everything is measured in the same run, interleaved, on the same tokens (8192 tokens, vocab 32768,
float32, CPU by default):

- baseline: ``log_softmax(logits).gather(target)`` -- what any trainer pays to get log pi;
- each case: controller statistics + correction weights + all mismatch and weight metrics + the single
  host sync that turns them into floats (``_correction_pass.correction_pass``), per kernel:
  * ``single``: ACRL on single-turn rows (a prompt, then one response);
  * ``multi``: the same config on the same ``[B, T]`` tokens laid out as agent trajectories (a
    prompt, then turns of 56 generated tokens separated by 24-token observations: loss_mask 0 there,
    turn_ids -1), turn_ids handed to the correction as the trainer hands them;
  * ``seq`` / ``seg``: ACRL with the ``geo_mis`` mask on the multi-turn rows, at ``correction.level``
    sequence and segment (the cost of taking the sequence-level unit per turn).

Each repeat times the baseline, then 5 calls of each case (their mean; the order of the cases reverses
between repeats); every figure is a side's minimum over the repeats. An overhead is a case's time over
the baseline's on the same ``[B, T]`` tokens, i.e. per token forwarded (0.001 means 0.1%). The last
lines are the figures as ``name: value``: ``fused-path overhead`` / ``torch-path overhead`` (single
turn), then ``... overhead multi-turn``, ``... multi/single`` (goal: 1 within noise) and
``... segment/sequence``. ``--tokens 512 --vocab 1024 --repeats 2`` is a smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from _correction_pass import correction_pass

from megatron_acrl.config import CorrectionConfig
from megatron_acrl.correction import AcrlController, MismatchTensors, acrl_discrepancy_stats, fused_cpu

TURN_TOKENS, OBS_TOKENS = 56, 24


def multi_turn_layout(b: int, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_mask [B, T] bool, turn_ids [B, T] int64)``: a prompt of ``t // 8`` tokens, then turns of
    TURN_TOKENS generated tokens separated by OBS_TOKENS observation tokens (mask 0, turn -1)."""
    mask = torch.zeros(b, t, dtype=torch.bool, device=device)
    turns = torch.full((b, t), -1, dtype=torch.int64, device=device)
    pos, k = t // 8, 0
    while pos < t:
        end = min(pos + TURN_TOKENS, t)
        mask[:, pos:end], turns[:, pos:end] = True, k
        pos, k = end + OBS_TOKENS, k + 1
    return mask, turns


def _cases(dev: torch.device) -> dict[str, tuple[str, CorrectionConfig, bool]]:
    """``case -> (layout, config, fused)`` for every kernel available: the kernel is resolved once, as
    the trainer's loss adapter does."""
    acrl = dataclasses.replace(CorrectionConfig(method="acrl", gamma=0.65), kernel="torch")
    masked = dataclasses.replace(acrl, masks=("geo_mis",), geo_low=0.5, geo_high=2.0)
    kernels = ["torch"] + (["fused_cpu"] if dev.type == "cpu" and fused_cpu.available() else [])
    out = {}
    for kernel in kernels:
        fused = fused_cpu.resolve_kernel(kernel, dev)
        for case, layout, cfg in (
            ("single", "single", acrl),
            ("multi", "multi", acrl),
            ("seq", "multi", masked),
            ("seg", "multi", dataclasses.replace(masked, level="segment")),
        ):
            out[f"{kernel}/{case}"] = (layout, dataclasses.replace(cfg, kernel=kernel), fused)
    return out


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
    b, t = max(args.tokens // args.seq_len, 1), min(args.seq_len, args.tokens)
    logits = torch.randn(args.tokens, args.vocab, device=dev)
    target = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    old = -torch.rand(b, t, device=dev) * 3
    roll = old + 0.05 * torch.randn(b, t, device=dev)
    single = torch.ones(b, t, dtype=torch.bool, device=dev)
    single[:, : t // 8] = False  # prompt tokens
    layouts = {"single": (single, torch.where(single, 0, -1)), "multi": multi_turn_layout(b, t, dev)}
    adv = torch.randn(b, 1, device=dev).expand(b, t)
    cases = _cases(dev)
    controllers = {}
    for name, (layout, cfg, fused) in cases.items():
        controllers[name] = ctl = AcrlController(cfg)
        ctl.update(
            acrl_discrepancy_stats(
                MismatchTensors(old, roll * 1.01, layouts[layout][0], fused=fused), cfg.distance
            )
        )

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def baseline() -> None:
        lp = torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1))
        lp.sum().item()

    def ours(name: str) -> None:
        layout, cfg, fused = cases[name]
        mask, turns = layouts[layout]
        n_tok, n_seq = int(mask.sum()), b
        correction_pass(
            cfg, controllers[name], old, roll, mask, adv, n_tok, n_seq, fused=fused, turn_ids=turns
        )

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up: allocator, thread pool
        baseline()
        for name in cases:
            ours(name)
    base_t: list[float] = []
    ours_t: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(args.repeats):
        base_t.append(timed(baseline))
        # The correction part is tiny; time 5 calls per sample (their mean) so timer resolution does
        # not dominate. Reverse the order of the cases every other repeat (the first is the coldest).
        order = list(cases) if rep % 2 == 0 else list(reversed(cases))
        for name in order:
            ours_t[name].append(timed(lambda name=name: [ours(name) for _ in range(5)]) / 5)
    _report(args, dev, base_t, ours_t, b * t)


def _report(args: argparse.Namespace, dev: torch.device, base_t: list[float], ours_t: dict[str, list[float]],
            positions: int) -> None:  # fmt: skip
    """The context lines, then the figures as ``name: value``. The minimum over repeats estimates each
    side's cost without the time other processes steal on a shared machine (every side is
    deterministic work); the medians are printed for context."""
    base = min(base_t)
    print(f"tokens: {args.tokens}  vocab: {args.vocab}  device: {dev}  threads: {torch.get_num_threads()}")
    print(f"log-prob from logits: min {base * 1e3:.2f} ms  median {statistics.median(base_t) * 1e3:.2f} ms")
    for name, times in ours_t.items():
        print(
            f"{name}: min {min(times) * 1e3:.3f} ms ({min(times) / positions * 1e9:.1f} ns/token)  "
            f"median {statistics.median(times) * 1e3:.3f} ms"
        )
    best = {name: min(times) for name, times in ours_t.items()}
    kernels = [k for k in ("fused_cpu", "torch") if f"{k}/single" in best]
    label = {"fused_cpu": "fused-path", "torch": "torch-path"}
    for k in kernels:
        print(f"{label[k]} overhead: {best[f'{k}/single'] / base:.6f}")
    for k in kernels:
        print(f"{label[k]} overhead multi-turn: {best[f'{k}/multi'] / base:.6f}")
    for k in kernels:
        print(f"{label[k]} multi/single: {best[f'{k}/multi'] / best[f'{k}/single']:.4f}")
    for k in kernels:
        print(f"{label[k]} segment/sequence: {best[f'{k}/seg'] / best[f'{k}/seq']:.4f}")


if __name__ == "__main__":
    main()
