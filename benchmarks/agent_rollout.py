"""Multi-turn agent rollouts against single-turn completions of the same length, on one real SGLang
CPU server.

    python benchmarks/agent_rollout.py [--trajectories 16 --turns 4 --turn-tokens 32 --reps 3]

Each rep generates the same workload two ways, (a) then (b) (b takes its lengths from a), the
server's prefix cache flushed before each:

* (a) multi-turn: ``--trajectories`` agent trajectories at once, each ``--turns`` turns of at most
  ``--turn-tokens`` generated ids with a short user reply appended after each turn, through the
  product's path: :class:`~megatron_acrl.rollout.agent.session.AgentSession` (token-in-token-out:
  each turn sends the ids so far, the reply is tokenized as a suffix against the chat template) over
  :class:`~megatron_acrl.rollout.agent.direct.ServerBackend` (the run's dispatch, the trajectory's id
  as its affinity key);
* (b) single-turn: one completion per trajectory from the same opening prompt, generating as many
  ids as that trajectory holds after its prompt (its generated turns plus the appended replies), all
  at once (``ignore_eos``: exactly that length).

Throughput is the trajectory ids after the opening prompt per second (the same count both ways, so
the ratio is how much longer the turns take than one completion of the same length); the stricter
``generated-id efficiency`` counts only (a)'s generated ids (its appended replies are prefilled, not
decoded) against all of (b)'s. The
prefix-cache hit rate is the server's own ``cached_tokens`` on turns >= 2 over what it could have
held (the previous turn's prompt + output). Prints each rep, then
``prefix-cache hit rate (turns >= 2): X`` (goal >= 0.9) and last ``multi-turn efficiency: X``
(a over b; goal >= 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rollout_bench import cores, load_average, median, model_dir, require_positive, server_spec  # noqa: E402

from megatron_acrl.rollout.agent.direct import ServerBackend  # noqa: E402
from megatron_acrl.rollout.agent.loop import run_trajectory  # noqa: E402
from megatron_acrl.rollout.agent.session import AgentSession, Trajectory  # noqa: E402
from megatron_acrl.rollout.agent.templates import TINY_CHATML  # noqa: E402
from megatron_acrl.rollout.trajectories import _TextTokenizer  # noqa: E402
from megatron_acrl.tasks.base import Prompt  # noqa: E402
from sglang_bridge.client import SGLangClient  # noqa: E402
from sglang_bridge.samples import Sample, SamplingParams  # noqa: E402
from sglang_bridge.server import SGLangServer  # noqa: E402

REPLY = "ok, go on with the next step please"


def scripted(turns: int) -> Any:
    """An agent that answers every turn with the same short user reply, ``turns`` turns in all."""

    async def agent(session: AgentSession, sample: Prompt) -> tuple[float, str]:
        await session.generate([{"role": "user", "content": sample.text}])
        for _ in range(turns - 1):
            await session.generate([{"role": "user", "content": REPLY}])
        return 0.0, "answered"

    return agent


class Recording(ServerBackend):
    """Keeps each turn's sample (its ``cached_tokens``) per affinity key."""

    def __init__(self, *a: Any, **k: Any):
        super().__init__(*a, **k)
        self.turns: dict[str, list[Sample]] = {}

    def generate_async(self, prompt_ids: Any, params: SamplingParams, *, affinity: str | None = None) -> Any:
        fut = super().generate_async(prompt_ids, params, affinity=affinity)

        def keep(f: Any) -> None:
            if not f.cancelled() and f.exception() is None:
                self.turns.setdefault(str(affinity), []).extend(f.result())

        fut.add_done_callback(keep)
        return fut


async def multi_turn(
    backend: Recording, tok: Any, texts: list[str], turns: int, params: SamplingParams, rep: int
) -> list[Trajectory]:
    agent = scripted(turns)

    async def one(i: int, text: str) -> Trajectory:
        session = AgentSession(
            backend, params, tok, TINY_CHATML, max_turns=turns, max_tokens=1 << 20, affinity=f"r{rep}-t{i}"
        )
        return await run_trajectory(agent, session, Prompt(text=text, answer="", uid=i))

    try:
        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(texts))))
    finally:
        await backend.aclose()


async def single_turn(url: str, trajs: list[Trajectory], params: SamplingParams, conc: int) -> int:
    def same_length(t: Trajectory) -> SamplingParams:
        return SamplingParams(
            temperature=params.temperature, max_new_tokens=len(t.output_ids), ignore_eos=True
        )

    async with SGLangClient(url, max_concurrency=conc) as c:
        outs = await asyncio.gather(*(c.generate_one(t.prompt_ids, same_length(t)) for t in trajs))
    return sum(len(s.output_ids) for s in outs)


async def flush(url: str) -> None:
    async with SGLangClient(url) as c:
        await c.flush_cache()


def hit_rate(turns: dict[str, list[Sample]]) -> tuple[int, int]:
    """(cached, cacheable) prompt ids over turns >= 2 of every trajectory."""
    cached = cacheable = 0
    for samples in turns.values():
        for prev, cur in zip(samples, samples[1:], strict=False):
            cached += int(cur.meta.get("cached_tokens", 0))
            cacheable += len(prev.prompt_ids) + len(prev.output_ids)
    return cached, cacheable


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectories", type=int, default=16, help="trajectories generated at once")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=32, help="max generated ids per turn")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--shared-cores", action="store_true", help="server and client on every core")
    ap.add_argument("--work-dir", default=None)
    args = ap.parse_args()
    require_positive(ap, args, "trajectories", "turns", "turn_tokens", "reps", "layers", "hidden")
    return args


def main() -> None:
    from transformers import AutoTokenizer

    args = parse_args()
    mine = cores()
    split = len(mine) >= 2 and not args.shared_cores
    rate: dict[str, list[float]] = {"multi-turn": [], "single-turn": [], "multi-turn generated": []}
    cached = cacheable = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        ckpt = model_dir(work, args.layers, args.hidden)
        tok = _TextTokenizer(AutoTokenizer.from_pretrained(str(ckpt)))
        texts = [f"Question {i}: what is {17 * i + 3} times {29 + i}?" for i in range(args.trajectories)]
        params = SamplingParams(temperature=1.0, max_new_tokens=args.turn_tokens)
        with SGLangServer(server_spec(ckpt, (mine[-1],) if split else None), work / "sglang.log", 600) as srv:
            if split:
                os.sched_setaffinity(0, set(mine[:-1]))
            print(
                f"{args.trajectories} trajectories x {args.turns} turns x <= {args.turn_tokens} ids, "
                f"server on {'core ' + str(mine[-1]) if split else 'every core'}"
            )
            for rep in range(-1, args.reps):  # rep -1: warm-up, not counted
                backend = Recording([srv.url], params, max_concurrency=args.trajectories)
                asyncio.run(flush(srv.url))
                t0 = time.perf_counter()
                trajs = asyncio.run(multi_turn(backend, tok, texts, args.turns, params, rep))
                t_a = time.perf_counter() - t0
                bad = [t.reason for t in trajs if t.reason != "answered"]
                if bad:
                    raise SystemExit(f"trajectories ended early: {bad}")
                n = sum(len(t.output_ids) for t in trajs)
                asyncio.run(flush(srv.url))
                t0 = time.perf_counter()
                n_b = asyncio.run(single_turn(srv.url, trajs, params, args.trajectories))
                t_b = time.perf_counter() - t0
                assert n_b == n, (n_b, n)
                if rep < 0:
                    continue
                c, k = hit_rate(backend.turns)
                cached, cacheable = cached + c, cacheable + k
                rate["multi-turn"].append(n / t_a)
                rate["single-turn"].append(n / t_b)
                gen = sum(sum(t.generated) for t in trajs)
                rate["multi-turn generated"].append(gen / t_a)
                print(
                    f"rep {rep}: multi-turn {n / t_a:7.0f} tok/s ({gen} generated + {n - gen} appended ids "
                    f"in {t_a:.2f} s), single-turn {n / t_b:7.0f} tok/s ({t_b:.2f} s), "
                    f"cache hits {c}/{k}",
                    flush=True,
                )
    for name, xs in rate.items():
        print(f"{name}: {median(xs):.0f} tokens/s")
    print(f"load average: {load_average()}")
    print(f"prefix-cache hit rate (turns >= 2): {cached / max(cacheable, 1):.3f}")
    # the stricter view: only the ids the server generated count for (a), all of (b)'s do
    gen_eff = median(rate["multi-turn generated"]) / median(rate["single-turn"])
    print(f"generated-id efficiency (a's generated ids only): {gen_eff:.3f}")
    print(f"multi-turn efficiency: {median(rate['multi-turn']) / median(rate['single-turn']):.3f}")


if __name__ == "__main__":
    main()
