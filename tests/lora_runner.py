"""Runs LoRA driver runs (``model.lora.sync: adapter``) in one process, with the async runner's
hooks and these (tests only; ``tests/test_lora_e2e.py``):

    python tests/lora_runner.py SPEC.json

* ``record_adapters: DIR`` -- every adapter pushed to the servers saved as ``DIR/<run>/<k>.pt``
  (``step-<k>`` pushes only) and every push's label appended to ``DIR/pushes-<run>.jsonl``; the
  adapter names the producer's requests acquired go to ``DIR/acquired-<run>.json``;
* ``snapshot_trainer: DIR`` -- the trainer's adapters and optimizer state saved after every
  optimizer step as ``DIR/<run>-after-<n>.pt``, and before the run's first one as
  ``DIR/<run>-before-1.pt`` (``<run>``: the hook's ``run`` value);
* ``score_adapters: {"rollouts": DIR, "adapters": DIR, "out": FILE}`` -- at the end, load each
  recorded adapter version again (under a name of its own) and let the server score every output
  token sampled under it (prefill log-probs, the request naming that adapter), also under the
  next version; per-version |difference| statistics go to FILE.

Each run's final driver state is written to ``<run_dir>/state.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import async_runner  # this directory is on sys.path: the runner is run as a script from it
import e2e_runner
import httpx
import torch

from megatron_acrl.batch.staleness import parse_version
from megatron_acrl.servers.lora_sync import adapter_name
from sglang_bridge.transport import auth_headers


def _record_adapters(ctx, directory: Path, run: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    update, adapters = ctx.servers.update_adapter, ctx.servers.adapters
    acquire, acquired = adapters.acquire, set()

    def recording(adapter, version):
        with (directory / f"pushes-{run}.jsonl").open("a") as f:
            f.write(json.dumps({"label": version, "name": adapter_name(version)}) + "\n")
        try:
            v = parse_version(version)
        except ValueError:  # the scorer's own loads
            v = None
        if v is not None:
            (directory / run).mkdir(exist_ok=True)
            torch.save({n: t.detach().clone() for n, t in adapter.items()}, directory / run / f"{v}.pt")
        return update(adapter, version)

    def counted():
        name = acquire()
        acquired.add(name)
        (directory / f"acquired-{run}.json").write_text(json.dumps(sorted(map(str, acquired))))
        return name

    ctx.servers.update_adapter = recording
    adapters.acquire = counted


def _snapshot_trainer(ctx, directory: Path, run: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    policy, count = ctx.policy, {"n": 0}
    train_step = policy.train_step

    def save(tag: str) -> None:  # one trainer rank in these runs: the state is all here
        state = {"adapters": policy.adapter_state(dst=None), "optimizer": policy.optimizer.state_dict()}
        torch.save(state, directory / f"{run}-{tag}.pt")

    def snapshotting(batch):
        if count["n"] == 0:
            save("before-1")
        out = train_step(batch)
        count["n"] += 1
        save(f"after-{count['n']}")
        return out

    policy.train_step = snapshotting


def _score(url: str, key: str, prompt: list[int], output: list[int], adapter: str) -> list[float]:
    """Prefill log-probs of ``output`` after ``prompt`` under ``adapter`` on the server at ``url``."""
    body = {
        "input_ids": prompt + output,
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": len(prompt) - 1,  # the entry at the start position has no log-prob
        "lora_path": adapter,
    }
    res = httpx.post(url + "/generate", json=body, headers=auth_headers(key), timeout=300)
    res.raise_for_status()
    mi = res.json()["meta_info"]
    return [x[0] for x in mi["input_token_logprobs"]][1 : len(output) + 1]


def _score_adapters(ctx, spec: dict) -> None:
    """Load each recorded version's adapter again and score the tokens sampled under it (and under
    the next version's adapter) with a request naming it."""
    rows = async_runner.sampled_rows(Path(spec["rollouts"]))
    adapters = Path(spec["adapters"])
    url, key, out = ctx.servers.urls[0], ctx.servers.api_key, {}
    for v in sorted({t for r in rows for t in r[3] if t >= 0}):
        for scored_as in (v, v + 1):
            paths = sorted(adapters.glob(f"*/{scored_as}.pt"))  # any run's copy: the test checks they agree
            if not paths:
                continue
            label = f"score-{v}-as-{scored_as}"
            ctx.servers.update_adapter(torch.load(paths[0]), label)
            diffs = []
            for prompt, output, lps, tv in rows:
                if v in tv:
                    got = _score(url, key, prompt, output, adapter_name(label))
                    diffs += [abs(g - lp) for g, lp, t in zip(got, lps, tv, strict=True) if t == v]
            out[f"{v}@{scored_as}"] = {"n": len(diffs), "max": max(diffs), "mean": sum(diffs) / len(diffs)}
    Path(spec["out"]).write_text(json.dumps(out, indent=1))


def prepare_for(hooks: dict):
    base = async_runner.prepare_for(hooks)
    run = str(hooks.get("run", "run"))

    def prepare(ctx):
        base(ctx)
        if "snapshot_trainer" in hooks:
            _snapshot_trainer(ctx, Path(hooks["snapshot_trainer"]), run)
        if "record_adapters" in hooks and ctx.servers is not None:
            _record_adapters(ctx, Path(hooks["record_adapters"]), run)
        if "score_adapters" in hooks and ctx.servers is not None:
            async_runner.score_before_close(ctx, lambda: _score_adapters(ctx, hooks["score_adapters"]))

    return prepare


def main() -> None:
    e2e_runner.main(prepare_for, key="hooks")  # the same loop over the spec, with these hooks


if __name__ == "__main__":
    main()
