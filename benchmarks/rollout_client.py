"""Our rollout client against a bare aiohttp client, on the same real SGLang CPU server.

    python benchmarks/rollout_client.py [--prompts 64 --n 8 --max-new-tokens 64 --concurrency 16 --reps 7]

Both send the same prompts with the same sampling (temperature 1, ``ignore_eos``, so both generate
exactly the same number of tokens) as one ``/generate`` request per group (a prompt's ``n``
samples, SGLang's ``n``) with the same number of requests in flight, alternating which goes first
every rep:

* ours: the product's path, :func:`sglang_bridge.fanout.fan_out` over an
  :class:`sglang_bridge.client.SGLangClient` (retries, the fan-out's bookkeeping, every sample
  unpacked into a :class:`Sample` with its log-probs, finish reason and weight versions);
* bare: an ``aiohttp`` session posting the same JSON and reading the answer, nothing else.

The server runs on the last core (``ServerSpec.cpus``, the CPU counterpart of its own GPU) and this
process on the others, so what the client spends competes only with itself, as on a GPU node
(``--shared-cores`` puts both on every core: the client's CPU time is then taken from the server's).
Prints each rep, the median tokens/s of both and the client CPU seconds per run, the load average,
then ``client efficiency: <ours / bare>`` (goal >= 0.95).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rollout_bench import (  # noqa: E402
    cores,
    load_average,
    median,
    model_dir,
    prompts,
    require_positive,
    server_spec,
)

from sglang_bridge.client import SamplingParams, SGLangClient  # noqa: E402
from sglang_bridge.fanout import fan_out  # noqa: E402
from sglang_bridge.server import SGLangServer  # noqa: E402


async def run_ours(url: str, ps: list[list[int]], params: SamplingParams, n: int, conc: int) -> int:
    async with SGLangClient(url, max_concurrency=conc) as c:
        result = await fan_out([c], ps, params, n, max_in_flight=conc)
    return sum(st.tokens for st in result.stats)


async def run_bare(url: str, ps: list[list[int]], params: SamplingParams, n: int, conc: int) -> int:
    sem = asyncio.Semaphore(conc)
    sampling = {**params.to_json(), "n": n}
    async with aiohttp.ClientSession() as s:

        async def one(p: list[int]) -> int:
            body = {"input_ids": p, "sampling_params": sampling, "return_logprob": True}
            body["logprob_start_len"] = len(p) - 1
            async with sem, s.post(url + "/generate", json=body) as r:
                r.raise_for_status()
                out = await r.json()
            return sum(len(o["output_ids"]) for o in out)

        return sum(await asyncio.gather(*(one(p) for p in ps)))


def timed(fn, *args) -> tuple[int, float, float]:  # noqa: ANN001 - one of the two runners
    cpu0, t0 = time.process_time(), time.perf_counter()
    tokens = asyncio.run(fn(*args))
    return tokens, time.perf_counter() - t0, time.process_time() - cpu0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (one request per group)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight, both clients")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--shared-cores", action="store_true", help="server and client on every core")
    ap.add_argument("--work-dir", default=None)
    args = ap.parse_args()
    require_positive(ap, args, "prompts", "n", "max_new_tokens", "concurrency", "reps")
    return args


def main() -> None:
    args = parse_args()
    mine = cores()
    split = len(mine) >= 2 and not args.shared_cores
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        ckpt = model_dir(work, args.layers, args.hidden)
        spec = server_spec(ckpt, (mine[-1],) if split else None)
        ps = prompts(args.prompts, 320, 8, 32, seed=0)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
        with SGLangServer(spec, work / "sglang-client-bench.log", startup_timeout_s=600) as srv:
            if split:
                os.sched_setaffinity(0, set(mine[:-1]))
            print(
                f"server on {'core ' + str(mine[-1]) if split else 'every core'}, "
                f"client on {sorted(os.sched_getaffinity(0))}"
            )
            print(
                f"{args.prompts} groups x n={args.n} x {args.max_new_tokens} tokens, "
                f"{args.concurrency} in flight"
            )
            bench = {"ours": run_ours, "bare": run_bare}
            for fn in bench.values():  # warm-up: connections, the server's first batches
                timed(fn, srv.url, ps[: args.concurrency], params, args.n, args.concurrency)
            rate: dict[str, list[float]] = {k: [] for k in bench}
            cpu: dict[str, list[float]] = {k: [] for k in bench}
            for rep in range(args.reps):
                order = list(bench) if rep % 2 == 0 else list(reversed(bench))
                line = []
                for name in order:
                    tokens, secs, cpu_s = timed(bench[name], srv.url, ps, params, args.n, args.concurrency)
                    assert tokens == args.prompts * args.n * args.max_new_tokens, (name, tokens)
                    rate[name].append(tokens / secs)
                    cpu[name].append(cpu_s)
                    line.append(f"{name} {tokens / secs:8.0f} tok/s ({cpu_s:.2f} s client CPU)")
                print(f"rep {rep}: " + "  ".join(line), flush=True)
    for name in bench:
        print(f"{name}: {median(rate[name]):.0f} tokens/s, {median(cpu[name]):.3f} s client CPU per run")
    print(f"load average: {load_average()}")
    print(f"client efficiency: {median(rate['ours']) / median(rate['bare']):.3f}")


if __name__ == "__main__":
    main()
