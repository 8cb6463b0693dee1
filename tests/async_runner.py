"""Runs several async (or lagged) driver runs in one process, with faults and recorders.

    python tests/async_runner.py SPEC.json

SPEC is a list of runs: ``{"config", "overrides", "args", "hooks": {...}}``. Hooks (through
``megatron_acrl.train.run``'s ``prepare``; tests only):

* ``sigterm_at_train_step: k`` -- SIGTERM to this process during the k-th optimizer step;
* ``kill_server_at_train_step: k`` -- kill the (local) SGLang server after the k-th optimizer step,
  while the producer's next requests are in flight;
* ``record_weights: DIR`` -- every weight set pushed to the servers, saved as ``DIR/<version>.pt``;
* ``score: {"rollouts": DIR, "weights": DIR, "out": FILE}`` -- at the end, push each recorded
  version again and let the server score every output token sampled under it (prefill log-probs),
  also under the next version; per-version |difference| statistics go to FILE.

Each run's final driver state is written to ``<run_dir>/state.json``.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import e2e_runner  # this directory is on sys.path: the runner is run as a script from it
import httpx
import torch

from megatron_acrl.batch.rollout_batch import load_rollouts
from megatron_acrl.batch.staleness import parse_version
from sglang_bridge.transport import auth_headers


def _after_train_step(ctx, k: int, action) -> None:
    train_step, count = ctx.policy.train_step, {"n": 0}

    def wrapped(batch):
        out = train_step(batch)
        count["n"] += 1
        if count["n"] == k:
            action()
        return out

    ctx.policy.train_step = wrapped


def _record_weights(ctx, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    update = ctx.servers.update_weights

    def recording(named_tensors, version, *, quantize=True, meta=None):
        weights = [(n, t.detach().clone()) for n, t in named_tensors]
        try:
            v = parse_version(version)
        except ValueError:  # an evaluation's or the scorer's own push
            v = None
        if v is not None:
            torch.save(dict(weights), directory / f"{v}.pt")
        return update(weights, version, quantize=quantize, meta=meta)

    ctx.servers.update_weights = recording


def _score(url: str, key: str, prompt: list[int], output: list[int]) -> list[float]:
    """Prefill log-probs of ``output`` after ``prompt`` under the server's current weights."""
    body = {
        "input_ids": prompt + output,
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": len(prompt) - 1,  # the entry at the start position has no log-prob
    }
    mi = httpx.post(url + "/generate", json=body, headers=auth_headers(key), timeout=300).json()["meta_info"]
    return [x[0] for x in mi["input_token_logprobs"]][1 : len(output) + 1]


def sampled_rows(rollouts: Path) -> list[tuple[list[int], list[int], list[float], list[int]]]:
    """(prompt, output, rollout log-probs, token versions) of every sample saved under ``rollouts``."""
    rows = []
    for f in sorted(rollouts.glob("step_*.pt")):
        b = load_rollouts(rollouts, int(f.stem.split("_")[1]))
        for i in range(len(b)):
            resp = b.loss_mask[i] > 0
            start = int(resp.nonzero()[0]) if resp.any() else b.tokens.shape[1]
            sl = slice(start, start + int(b.response_len[i]))
            rows.append(
                (
                    b.tokens[i, :start].tolist(),
                    b.tokens[i, sl].tolist(),
                    b.rollout_logprobs[i, sl].tolist(),
                    b.token_versions[i, sl].tolist(),
                )
            )
    return rows


def _score_segments(ctx, spec: dict) -> None:
    """Push each recorded version, score the tokens sampled under it (and under the next version)."""
    rollouts, weights = Path(spec["rollouts"]), Path(spec["weights"])
    rows = sampled_rows(rollouts)
    versions = sorted({v for r in rows for v in r[3]})
    url = ctx.servers.urls[0]
    out = {}
    for v in versions:
        for scored_as in (v, v + 1):
            path = weights / f"{scored_as}.pt"
            if not path.exists():
                continue
            ctx.servers.update_weights(list(torch.load(path).items()), f"score-{scored_as}")
            diffs = []
            for prompt, output, lps, tv in rows:
                if v not in tv:
                    continue
                got = _score(url, ctx.servers.api_key, prompt, output)
                diffs += [abs(g - lp) for g, lp, t in zip(got, lps, tv, strict=True) if t == v]
            out[f"{v}@{scored_as}"] = {"n": len(diffs), "max": max(diffs), "mean": sum(diffs) / len(diffs)}
    Path(spec["out"]).write_text(json.dumps(out, indent=1))


def prepare_for(hooks: dict):
    def prepare(ctx):
        if "sigterm_at_train_step" in hooks:
            _after_train_step(
                ctx, hooks["sigterm_at_train_step"], lambda: os.kill(os.getpid(), signal.SIGTERM)
            )
        if "kill_server_at_train_step" in hooks:
            _after_train_step(ctx, hooks["kill_server_at_train_step"], lambda: ctx.servers.servers[0].kill())
        if "record_weights" in hooks and ctx.servers is not None:
            _record_weights(ctx, Path(hooks["record_weights"]))
        if "score" in hooks and ctx.servers is not None:
            score_before_close(ctx, lambda: _score_segments(ctx, hooks["score"]))

    return prepare


def score_before_close(ctx, score) -> None:
    """Run ``score()`` when the run closes, while its servers still answer (then close as before)."""
    close = ctx.close

    def scored_close():
        if ctx.servers is not None:
            score()
        close()

    ctx.close = scored_close


def main() -> None:
    e2e_runner.main(prepare_for, key="hooks")  # the same loop over the spec, with these hooks


if __name__ == "__main__":
    main()
