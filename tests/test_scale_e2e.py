"""The RL loop at scale, end to end: two real SGLang CPU servers behind a real sglang-router, and
token-budget micro-batches in the real Megatron trainer. One server is killed right before step 1's
generation: the step still gets every group (the router retries elsewhere), the server is restarted
at the next weight sync and put back into the router. The routing, load and micro-batch metrics
reach ``metrics.jsonl``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_e2e import BASE, CONFIG, rows, run_spec

# ~2 min (two servers, a Megatron rank, three steps); tests/bridge/test_routing.py is the fast variant.
pytestmark = pytest.mark.slow

STEPS = 3


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("scale-e2e")
    os.environ.setdefault("ACRL_SCALE_E2E_KEY", "scale-e2e-" + os.urandom(6).hex())
    overrides = [
        *BASE,
        f"training.num_steps={STEPS}",
        "rollout.num_servers=2",
        "rollout.router=sglang",
        "rollout.router_policy=cache_aware",
        "rollout.api_key_env=ACRL_SCALE_E2E_KEY",
        # 16 prompt + 6 new tokens at most: a budget of 2-3 sequences per micro-batch
        "training.max_tokens_per_microbatch=48",
        "training.max_tokens_per_logprob_microbatch=96",
    ]
    spec = [
        {
            "config": CONFIG,
            "overrides": overrides,
            "args": ["--run-dir", str(tmp / "run")],
            "faults": {"kill_server_at_step": 1},
        }
    ]
    run_spec(tmp, spec)
    return tmp / "run"


def test_a_routed_budget_run_trains_through_a_dead_server(scaled: Path) -> None:
    got = rows(scaled)
    assert [int(r["step"]) for r in got] == list(range(1, STEPS + 1))
    for r in got:
        assert r["rollout/router_policy"] == 1.0  # cache_aware
        assert r["rollout/server_load/0"] >= 0 and r["rollout/server_load/1"] >= 0  # sampled from the router
        assert 0.0 <= r["perf/padding_fraction"] < 1.0 and r["perf/microbatches"] >= 2
    # the killed server was restarted (once) and served again after its re-add
    assert max(r.get("sync/restarts", 0.0) + r.get("rollout/server_restarts", 0.0) for r in got) >= 1
