"""Fixed vs token-budget micro-batches: the train step's forward + backward on a long-tailed batch.

    python benchmarks/microbatch.py [--prompts 8 --n 4 --max-new-tokens 1024 --reps 3]

One Megatron rank (TP = PP = DP = 1, gloo, this CPU), the tiny model family, two policies with the
same weights: one cutting ``training.micro_batch_size`` sequences per micro-batch, every micro-batch
padded to the batch's longest sequence; one cutting by ``training.max_tokens_per_microbatch``
(default: micro_batch_size x that longest length, so no budget micro-batch holds more tokens than a
fixed one). Both run ``Policy.train_step`` (forward, backward and the optimizer step) on the same
batch, alternating which goes first every rep.

The batch is reasoning-like: prompts of 32..96 tokens, response lengths log-normal with median
``--median-frac`` (0.2) of max_new_tokens and log-std ``--sigma`` (0.8), clipped to
``[16, max_new_tokens]`` -- a long right tail, and a few percent of responses hitting the cap as
truncated long chains of thought do (the shape of response-length histograms of long-CoT math RL
runs: most answers well under the limit, a tail to it). Seeded.

Peak activation memory: the rise of the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` before each step, freed memory handed back with ``malloc_trim`` and
glibc's mmap threshold pinned so large tensors are returned to the system when freed) over the
resident set before the step, median over the reps. Prints the padding fractions, both medians,
then ``train time ratio: <budget / fixed>`` (goal <= 0.7, with budget peak memory <= fixed).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rollout_bench import heavy_tailed_lengths, load_average, median  # noqa: E402

from megatron_acrl.config import config_from_dict  # noqa: E402
from megatron_acrl.megatron import cpu_compat  # noqa: E402
from megatron_acrl.megatron.base import initialize_parallel  # noqa: E402
from megatron_acrl.megatron.policy import Policy  # noqa: E402
from sglang_bridge.server import free_port  # noqa: E402

_LIBC = ctypes.CDLL("libc.so.6")
M_MMAP_THRESHOLD = -3


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measured_step(policy: Policy, batch: dict[str, torch.Tensor]) -> tuple[float, float, dict[str, float]]:
    """(seconds, peak MiB above the resident set before the step, metrics) of one train step."""
    _LIBC.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    metrics = policy.train_step(batch)
    seconds = time.perf_counter() - t0
    return seconds, (_status_kib("VmHWM") - before) / 1024, metrics


def make_batch(args: argparse.Namespace, vocab: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(args.seed)
    n = args.prompts * args.n
    prompt_lens = np.repeat(rng.integers(32, 97, size=args.prompts), args.n)
    resp = heavy_tailed_lengths(
        n, args.median_frac * args.max_new_tokens, args.sigma, 16, args.max_new_tokens, args.seed + 1
    )
    width = int(max(p + r for p, r in zip(prompt_lens, resp, strict=True)))
    tokens = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width)
    for i, (p, r) in enumerate(zip(prompt_lens, resp, strict=True)):
        tokens[i, : p + r] = torch.from_numpy(rng.integers(3, vocab, size=p + r))
        mask[i, p : p + r] = 1
    g = torch.Generator().manual_seed(args.seed)
    old = -torch.rand(n, width, generator=g) * mask
    adv = torch.randn(n, 1, generator=g).expand(n, width) * mask
    return dict(
        tokens=tokens,
        loss_mask=mask,
        old_logprobs=old,
        rollout_logprobs=(old + 0.05 * torch.randn(n, width, generator=g)) * mask,
        advantages=adv.contiguous(),
    )


def config(args: argparse.Namespace, budget: int | None):  # noqa: ANN201 - a Config
    return config_from_dict(
        {
            "model": dict(
                num_layers=args.layers,
                hidden_size=args.hidden,
                ffn_hidden_size=2 * args.hidden,
                num_attention_heads=4,
                num_query_groups=2,
                max_position_embeddings=4096,
                params_dtype="fp32",
            ),
            "rollout": {"max_new_tokens": args.max_new_tokens, "max_prompt_len": 96},
            "training": {
                "lr": 1e-6,
                "micro_batch_size": args.micro_batch_size,
                "max_tokens_per_microbatch": budget,
                "seed": args.seed,
            },
            "correction": {"method": "tis"},
        }
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--median-frac", type=float, default=0.2)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--budget", type=int, default=None, help="tokens (default: micro_batch_size x longest)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if (args.prompts * args.n) % args.micro_batch_size:
        ap.error("--prompts x --n must be a multiple of --micro-batch-size")
    return args


def main() -> None:
    args = parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    cpu_compat.apply()
    _LIBC.mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # fixed: freed large tensors go back to the system
    fixed_cfg = config(args, None)
    batch = make_batch(args, fixed_cfg.model.vocab_size)
    width = batch["tokens"].shape[1]
    budget = args.budget or args.micro_batch_size * width
    initialize_parallel(fixed_cfg.parallel, args.seed)
    policies = {
        "fixed": Policy(fixed_cfg),
        "budget": Policy(
            dataclasses.replace(
                fixed_cfg, training=dataclasses.replace(fixed_cfg.training, max_tokens_per_microbatch=budget)
            )
        ),
    }
    policies["budget"].load_hf(dict(policies["fixed"].hf_weights()))  # the same weights
    lens = batch["loss_mask"].sum(1)
    print(
        f"{len(lens)} sequences, longest {width} tokens, responses median {lens.median():.0f} "
        f"(max_new_tokens {args.max_new_tokens}, {(lens >= args.max_new_tokens).float().mean():.0%} "
        "at the cap); "
        f"fixed: micro_batch_size {args.micro_batch_size}; budget: {budget} tokens"
    )
    for p in policies.values():  # warm-up: optimizer state, allocator
        p.train_step(batch)
    secs: dict[str, list[float]] = {k: [] for k in policies}
    peak: dict[str, list[float]] = {k: [] for k in policies}
    pad: dict[str, float] = {}
    for rep in range(args.reps):
        order = list(policies) if rep % 2 == 0 else list(reversed(policies))
        for name in order:
            s, mib, m = measured_step(policies[name], batch)
            secs[name].append(s)
            peak[name].append(mib)
            pad[name] = m["perf/padding_fraction"]
            print(
                f"rep {rep} {name:>6s}: {s:6.2f} s, peak +{mib:7.1f} MiB, "
                f"{m['perf/microbatches']:.0f} micro-batches",
                flush=True,
            )
    for name in policies:
        print(f"padding fraction {name}: {pad[name]:.3f}")
    for name in policies:
        print(
            f"{name}: train step {median(secs[name]):.2f} s, "
            f"peak activation memory {median(peak[name]):.1f} MiB"
        )
    mem_ok = median(peak["budget"]) <= median(peak["fixed"])
    print(f"peak activation memory budget <= fixed: {'yes' if mem_ok else 'no'}")
    print(f"load average: {load_average()}")
    print(f"train time ratio: {median(secs['budget']) / median(secs['fixed']):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
