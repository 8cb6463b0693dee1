"""Routing a long-tailed rollout over two real SGLang CPU servers: round-robin vs least-outstanding
vs sglang-router, in one run, alternating.

    python benchmarks/routing.py [--groups 128 --n 2 --median-tokens 32 --max-tokens 256
                                  --concurrency 4 --reps 3]

Two servers, each pinned to its own core (``ServerSpec.cpus``, as ``rollout.server_cpus`` does).
The workload: ``groups`` prompts, each asking for ``n`` samples (one request per group) of a
max_new_tokens drawn from a log-normal (median ``--median-tokens``, log-std ``--sigma``) clipped to
``[8, --max-tokens]`` (seeded; ``ignore_eos``, so every request generates exactly that many tokens):
a heavy right tail, as response lengths in RL are. Each strategy keeps at most ``--concurrency``
requests in flight per server (about what a server runs at once):

* ``round_robin``: group i to server i % 2 up front (the static split the driver used before);
* ``least_outstanding`` (the default, ``rollout.router: none``): each request, when a slot frees, to
  the server with the fewest in flight;
* ``sglang_router`` (``rollout.router: sglang``, ``--policy``): everything through a real
  sglang-router holding both servers, ``2 x --concurrency`` requests in flight to it.

For each strategy: the makespan (wall time of the whole rollout) and the balanced ideal (total server
busy time / 2, the busy time being each server's process-tree CPU seconds: a server pinned to one core
is busy exactly while it uses it), medians over the reps. The last line is ``routing efficiency:
<ideal / makespan of least_outstanding>`` (goal >= 0.85; and it beats round_robin).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rollout_bench import (  # noqa: E402
    cores,
    heavy_tailed_lengths,
    load_average,
    median,
    model_dir,
    prompts,
    require_positive,
    server_spec,
    tree_cpu_seconds,
)

from sglang_bridge.client import SamplingParams, SGLangClient  # noqa: E402
from sglang_bridge.fanout import fan_out  # noqa: E402
from sglang_bridge.router import POLICIES, RouterSpec, SGLangRouter  # noqa: E402
from sglang_bridge.server import ServerGroup  # noqa: E402

STRATEGIES = ("round_robin", "least_outstanding", "sglang_router")
DEFAULT = "least_outstanding"


async def rollout(urls: list[str], strategy: str, ps, params, n: int, conc: int) -> int:  # noqa: ANN001
    clients = [
        SGLangClient(u, max_concurrency=conc * (2 if strategy == "sglang_router" else 1)) for u in urls
    ]
    try:
        if strategy == "sglang_router":
            result = await fan_out(clients, ps, params, n, max_in_flight=2 * conc)
        else:
            result = await fan_out(clients, ps, params, n, policy=strategy, max_in_flight=conc)  # type: ignore[arg-type]
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return sum(st.tokens for st in result.stats)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=128)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--median-tokens", type=float, default=32)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight per server")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--policy", default="cache_aware", choices=POLICIES, help="sglang-router's policy")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=None)
    args = ap.parse_args()
    require_positive(ap, args, "groups", "n", "max_tokens", "concurrency", "reps")
    return args


def main() -> None:
    args = parse_args()
    mine = cores()
    pinned = [(mine[0],), (mine[-1],)] if len(mine) >= 2 else [None, None]
    lengths = heavy_tailed_lengths(args.groups, args.median_tokens, args.sigma, 8, args.max_tokens, args.seed)
    ps = prompts(args.groups, 320, 8, 24, seed=args.seed)
    params = [SamplingParams(temperature=1.0, max_new_tokens=m, ignore_eos=True) for m in lengths]
    expected = args.n * sum(lengths)
    print(
        f"{args.groups} groups x n={args.n}, max_new_tokens log-normal(median {args.median_tokens:g}, "
        f"sigma {args.sigma:g}) in [8, {args.max_tokens}]: mean {sum(lengths) / len(lengths):.1f}, "
        f"longest {max(lengths)}, {expected} tokens; {args.concurrency} in flight per server"
    )
    makespan: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    ideal: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        ckpt = model_dir(work, args.layers, args.hidden)
        specs = [server_spec(ckpt, c) for c in pinned]
        with ServerGroup(specs, log_dir=work, startup_timeout_s=600) as group:
            urls = group.urls
            router_spec = RouterSpec(worker_urls=tuple(urls), policy=args.policy)
            with SGLangRouter(router_spec, work / "router.log") as router:
                print(
                    f"servers on cores {[c[0] if c else 'all' for c in pinned]}: {urls}; router {router.url}"
                )
                targets = {s: [router.url] if s == "sglang_router" else urls for s in STRATEGIES}
                asyncio.run(rollout(urls, DEFAULT, ps[:8], params[:8], args.n, args.concurrency))  # warm-up
                for rep in range(args.reps):
                    order = STRATEGIES if rep % 2 == 0 else tuple(reversed(STRATEGIES))
                    for s in order:
                        busy0 = [tree_cpu_seconds(srv.pid or 0) for srv in group.servers]
                        t0 = time.perf_counter()
                        tokens = asyncio.run(rollout(targets[s], s, ps, params, args.n, args.concurrency))
                        wall = time.perf_counter() - t0
                        busy = [
                            tree_cpu_seconds(srv.pid or 0) - b
                            for srv, b in zip(group.servers, busy0, strict=True)
                        ]
                        assert tokens == expected, (s, tokens, expected)
                        makespan[s].append(wall)
                        ideal[s].append(sum(busy) / 2)
                        print(
                            f"rep {rep} {s:>17s}: makespan {wall:6.2f} s, server busy "
                            f"{busy[0]:6.2f} + {busy[1]:6.2f} s, ideal {sum(busy) / 2:6.2f} s",
                            flush=True,
                        )
    for s in STRATEGIES:
        m, i = median(makespan[s]), median(ideal[s])
        print(f"{s}: makespan {m:.2f} s, balanced ideal {i:.2f} s, efficiency {i / m:.3f}")
    rr, lo = median(makespan["round_robin"]), median(makespan[DEFAULT])
    print(
        f"{DEFAULT} vs round_robin makespan: {lo:.2f} s vs {rr:.2f} s "
        f"({'beats' if lo < rr else 'does not beat'})"
    )
    print(f"load average: {load_average()}")
    print(f"routing efficiency: {median(ideal[DEFAULT]) / lo:.3f}")


if __name__ == "__main__":
    main()
