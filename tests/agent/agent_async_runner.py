"""The async runner (``tests/async_runner.py``) for agent runs, with one more hook:

    python tests/agent/agent_async_runner.py SPEC.json

* ``score_turns: {"rollouts": DIR, "weights": DIR, "out": FILE}`` -- at the end, push each recorded
  weight version again and let the server score every trajectory's tokens from its first generated
  one (teacher-forced prefill log-probs; the observations in between are scored too, and skipped);
  per version v, ``"v@v"`` and ``"v@v+1"``: |rollout log-prob - score| over the generated tokens
  that version v sampled, under v's weights and under the next version's. Also how many rows span
  versions, between turns and inside one (``"spans"``).

* ``push_mid_trajectory: t`` -- from a run's second optimizer step on, the step first waits (at
  most ``t`` seconds) until some trajectory has finished one or two of its three turns, so that the
  push after it lands in the middle of trajectories (on this CPU the tiny model trains in a fraction
  of a second, and a step's groups tend to finish together, so an untimed push rarely does).

Every hook of ``tests/async_runner.py`` works as there (``sigterm_at_train_step``,
``record_weights``, ...).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the runners' helper modules

import async_runner  # noqa: E402
import e2e_runner  # noqa: E402
import torch  # noqa: E402

from megatron_acrl.batch.rollout_batch import load_rollouts  # noqa: E402


def _rows(rollouts: Path) -> list[tuple[list[int], list[int], list[float], list[int], list[int]]]:
    """Per trained row: (prefix before the first generated id, the ids from there to the last
    generated one, their rollout log-probs, versions and turns)."""
    rows = []
    for f in sorted(rollouts.glob("step_*.pt")):
        b = load_rollouts(rollouts, int(f.stem.split("_")[1]))
        assert b.token_versions is not None and b.turn_ids is not None
        for i in range(len(b)):
            gen = (b.loss_mask[i] > 0).nonzero().flatten()
            if len(gen) == 0:
                continue
            lo, hi = int(gen[0]), int(gen[-1]) + 1
            rows.append(
                (
                    b.tokens[i, :lo].tolist(),
                    b.tokens[i, lo:hi].tolist(),
                    b.rollout_logprobs[i, lo:hi].tolist(),
                    b.token_versions[i, lo:hi].tolist(),
                    b.turn_ids[i, lo:hi].tolist(),
                )
            )
    return rows


def _spans(rows: list) -> dict[str, int]:
    """Rows whose generated ids carry more than one version: across turns, and inside a turn."""
    between = inside = 0
    for *_, versions, turns in rows:
        per_turn: dict[int, set[int]] = {}
        for v, t in zip(versions, turns, strict=True):
            if t >= 0:
                per_turn.setdefault(t, set()).add(v)
        inside += any(len(s) > 1 for s in per_turn.values())
        ordered = [per_turn[t] for t in sorted(per_turn)]
        between += any(max(a) < min(b) for a, b in zip(ordered, ordered[1:], strict=False))
    return {"rows": len(rows), "between_turns": between, "inside_turn": inside}


def _score_turns(ctx, spec: dict) -> None:
    rows = _rows(Path(spec["rollouts"]))
    weights = Path(spec["weights"])
    versions = sorted({v for r in rows for v in r[3] if v >= 0})
    url = ctx.servers.urls[0]
    out: dict = {"spans": _spans(rows)}
    for v in versions:
        for scored_as in (v, v + 1):
            path = weights / f"{scored_as}.pt"
            if not path.exists():
                continue
            ctx.servers.update_weights(list(torch.load(path).items()), f"score-{scored_as}")
            diffs = []
            for prefix, ids, lps, tv, _ in rows:
                if v not in tv:
                    continue
                got = async_runner._score(url, ctx.servers.api_key, prefix, ids)
                diffs += [abs(g - lp) for g, lp, t in zip(got, lps, tv, strict=True) if t == v]
            out[f"{v}@{scored_as}"] = {"n": len(diffs), "max": max(diffs), "mean": sum(diffs) / len(diffs)}
    Path(spec["out"]).write_text(json.dumps(out, indent=1))


def _push_mid_trajectory(ctx, limit_s: float) -> None:
    """The ``push_mid_trajectory`` hook (module doc): turns finished per trajectory (affinity key)
    are counted as the servers answer them."""
    done: dict[str, int] = {}
    generate = ctx.servers.generate_async

    def counting(prompts, params, *, affinity=None):
        sent = generate(prompts, params, affinity=affinity)
        if affinity is not None:
            sent.add_done_callback(lambda _f: done.__setitem__(affinity, done.get(affinity, 0) + 1))
        return sent

    ctx.servers.generate_async = counting
    train_step, count = ctx.policy.train_step, {"n": 0}

    def waiting(batch):
        count["n"] += 1
        deadline = time.monotonic() + limit_s
        while count["n"] > 1 and time.monotonic() < deadline and not {1, 2} & set(done.values()):
            time.sleep(0.02)
        return train_step(batch)

    ctx.policy.train_step = waiting


def prepare_for(hooks: dict):
    base = async_runner.prepare_for(
        {k: v for k, v in hooks.items() if k not in ("score_turns", "push_mid_trajectory")}
    )

    def prepare(ctx) -> None:
        base(ctx)
        if "push_mid_trajectory" in hooks:
            _push_mid_trajectory(ctx, float(hooks["push_mid_trajectory"]))
        if "score_turns" in hooks and ctx.servers is not None:
            close = ctx.close

            def scored_close() -> None:
                if ctx.servers is not None:
                    _score_turns(ctx, hooks["score_turns"])
                close()

            ctx.close = scored_close

    return prepare


if __name__ == "__main__":
    e2e_runner.main(prepare_for, key="hooks")
