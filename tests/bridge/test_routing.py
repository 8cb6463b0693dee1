"""Rollouts at scale on real servers: one request per group, least-outstanding fan-out that loses no
group when a server dies, and sglang-router in front of the driver's servers (same API key on both
sides, the key never on a command line), which drops a killed server at once and takes it back only
after its restart and a weight sync."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from megatron_acrl.config import load_config
from megatron_acrl.servers.handle import RolloutServers
from sglang_bridge.client import SamplingParams, SGLangClient
from sglang_bridge.fanout import fan_out
from sglang_bridge.router import POLICIES, RouterError, RouterSpec
from sglang_bridge.server import SGLangServer, free_port
from sglang_bridge.weight_sync import Manifest

KEY_ENV = "ACRL_TEST_ROUTER_KEY"
PROMPTS = [[7 + i, 17, 42, 99, 3 + i % 5] for i in range(12)]


def test_a_group_is_one_request_with_its_n_samples(sglang_server: SGLangServer) -> None:
    async def go() -> list:
        async with SGLangClient(sglang_server.url) as c:
            return await c.generate_group(PROMPTS[0], SamplingParams(max_new_tokens=5, ignore_eos=True), 3)

    group = asyncio.run(go())
    assert len(group) == 3 and all(len(s.output_ids) == 5 == len(s.rollout_logprobs) for s in group)
    assert len({tuple(s.output_ids) for s in group}) > 1  # n different samples, not one repeated
    # the prompt was computed once: the samples after the first found it in the prefix cache
    assert max(s.meta.get("cached_tokens", 0) for s in group) >= len(PROMPTS[0]) - 1


@pytest.mark.parametrize("policy", ["least_outstanding", "round_robin"])
def test_fan_out_moves_a_dead_servers_groups_to_the_others(sglang_server: SGLangServer, policy: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the server is gone

    async def go():
        clients = [SGLangClient(sglang_server.url), SGLangClient(dead, retries=1, backoff_s=0.01)]
        try:
            return await fan_out(
                clients, PROMPTS, SamplingParams(max_new_tokens=4), 2, policy=policy, max_in_flight=2
            )
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    result = asyncio.run(go())
    assert [len(g) for g in result.groups] == [2] * len(PROMPTS)  # no group lost
    live, gone = result.stats
    assert live.samples == 2 * len(PROMPTS) and live.requests == len(PROMPTS)
    assert gone.failed and gone.samples == 0 and result.requeued >= 1


# ------------------------------------------------------------------------------------------------
# The driver's servers behind sglang-router
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def routed(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutServers]:
    os.environ[KEY_ENV] = "router-test-key-" + os.urandom(6).hex()
    cfg = load_config(
        None,
        [
            "rollout.num_servers=2",
            "rollout.router=sglang",
            "rollout.router_policy=cache_aware",
            "rollout.quantization=none",
            "rollout.device=cpu",
            f"rollout.api_key_env={KEY_ENV}",
            "rollout.max_new_tokens=24",
            "rollout.max_concurrency=3",
            "rollout.startup_timeout_s=300",
        ],
    )
    servers = RolloutServers(cfg, tiny_ckpt, tmp_path_factory.mktemp("routed-logs"))
    try:
        yield servers
    finally:
        servers.close()
        os.environ.pop(KEY_ENV, None)


def _weights(tiny_ckpt: Path, scale: float) -> dict[str, torch.Tensor]:
    served = Manifest.from_checkpoint(tiny_ckpt).tensors
    return {k: v * scale for k, v in load_file(str(tiny_ckpt / "model.safetensors")).items() if k in served}


def _versions(servers: RolloutServers) -> list[str]:
    async def go() -> list[str]:
        out = []
        for url in servers.urls:
            async with SGLangClient(url, api_key=servers.api_key) as c:
                out.append(await c.weight_version())
        return out

    return asyncio.run(go())


def test_rollout_and_weight_sync_through_the_router(routed: RolloutServers, tiny_ckpt: Path) -> None:
    router = routed.router
    assert router is not None and set(router.workers()) == set(routed.urls)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    groups = routed.generate(PROMPTS, 3, params)
    assert [len(g) for g in groups] == [3] * len(PROMPTS)
    m = routed.load_metrics()
    assert m["rollout/router_policy"] == 1.0  # cache_aware
    assert {"rollout/server_load/0", "rollout/server_load/1", "rollout/load_imbalance"} <= set(m)
    assert m["rollout/server_load/0"] + m["rollout/server_load/1"] > 0

    routed.update_weights(_weights(tiny_ckpt, 1.01).items(), "v1")  # to each server, not the router
    assert _versions(routed) == ["v1", "v1"]
    assert {s.weight_version for g in routed.generate(PROMPTS[:4], 2, params) for s in g} == {"v1"}


def test_the_router_holds_the_key_on_both_sides(routed: RolloutServers) -> None:
    router = routed.router
    assert router is not None and routed.api_key
    cmdline = Path(f"/proc/{router._proc.pid}/cmdline").read_bytes()  # type: ignore[union-attr]
    assert routed.api_key.encode() not in cmdline  # stdin, never argv
    environ = Path(f"/proc/{router._proc.pid}/environ").read_bytes()  # type: ignore[union-attr]
    assert routed.api_key.encode() not in environ

    async def without_key() -> int:
        async with SGLangClient(router.url, retries=0) as c:
            try:
                await c.generate_group(PROMPTS[0], SamplingParams(max_new_tokens=2), 1)
            except Exception as e:  # noqa: BLE001 - the status is what is checked
                return int(getattr(e, "status", 0))
        return 200

    assert asyncio.run(without_key()) == 401


def test_killing_a_server_mid_rollout_loses_no_group(routed: RolloutServers, tiny_ckpt: Path) -> None:
    router = routed.router
    assert router is not None
    victim = routed.servers[1]
    killed = threading.Event()

    def kill_when_busy() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed.is_set():
            if router.loads().get(victim.url, 0) > 0:  # requests in flight on it
                victim.kill()
                killed.set()
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    try:
        groups = routed.generate(PROMPTS * 2, 3, params)
    finally:
        killed.set()
        killer.join()
    assert [len(g) for g in groups] == [3] * 2 * len(PROMPTS)  # every group, all samples
    assert all(len(s.output_ids) == 48 for g in groups for s in g)
    assert routed.dead_servers() == [1]
    assert set(router.workers()) == {routed.urls[0]}  # dropped from rotation at once

    restarts = routed.restarts
    routed.update_weights(_weights(tiny_ckpt, 1.02).items(), "v2")  # restarts it, syncs, re-adds it
    assert routed.restarts == restarts + 1 and not routed.dead_servers()
    held = router.workers()
    assert set(held) == set(routed.urls) and all(w["is_healthy"] for w in held.values())
    assert _versions(routed) == ["v2", "v2"]
    assert {s.weight_version for g in routed.generate(PROMPTS, 2, params) for s in g} == {"v2"}


def test_router_spec_refuses_what_the_router_does_not_know() -> None:
    from sglang_router.router import policy_from_str

    # every policy we offer, sglang-router 0.3.2 takes through RouterArgs, the path the bridge starts
    # it by (its CLI's choices lack consistent_hashing, which the Rust router has)
    assert all(policy_from_str(p) is not None for p in POLICIES)
    with pytest.raises(ValueError, match="policies are"):
        RouterSpec(worker_urls=("http://127.0.0.1:1",), policy="manual")
    assert issubclass(RouterError, RuntimeError)


def test_the_router_times_requests_by_its_own_knob() -> None:
    """sglang-router's request_timeout_secs counts a worker's queue too, so it has its own knob
    (rollout.router_timeout_s, default request_timeout_s), passed in the whole seconds it takes."""
    from sglang_router.router_args import RouterArgs

    from megatron_acrl.config import RolloutConfig
    from megatron_acrl.servers.handle import router_spec

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    spec = router_spec(RolloutConfig(request_timeout_s=60.0, router_timeout_s=3600.0), urls, "k")
    args = spec.router_args(port=1, prometheus_port=2)
    assert args["request_timeout_secs"] == 3600 and args["worker_urls"] == urls
    RouterArgs(**args)  # a value sglang-router takes
    assert router_spec(RolloutConfig(request_timeout_s=60.0), urls, "k").request_timeout_s == 60
    assert router_spec(RolloutConfig(request_timeout_s=0.4), urls, "k").request_timeout_s == 1


def test_a_dead_router_is_started_again(routed: RolloutServers) -> None:
    from sglang_bridge.client import ServerGoneError

    old = routed.router
    assert old is not None and old._proc is not None
    old._proc.kill()
    old._proc.wait(timeout=30)
    with pytest.raises(ServerGoneError, match="sglang-router exited"):
        routed.generate(PROMPTS[:2], 2, SamplingParams(max_new_tokens=4))
    restarts = routed.restarts
    routed.restart()  # the servers live: only the router comes back
    assert routed.restarts == restarts + 1 and routed.router is not None and routed.router is not old
    assert set(routed.router.workers()) == set(routed.urls)
    groups = routed.generate(PROMPTS[:4], 2, SamplingParams(max_new_tokens=4))
    assert [len(g) for g in groups] == [2] * 4


def test_an_async_run_generates_through_the_router(routed: RolloutServers, tiny_ckpt: Path) -> None:
    """``rollout.mode: async`` with ``rollout.router: sglang``: the generation engine asks the backend,
    whose one dispatch path sends every request to the router it started (each sample names the URL
    its request went to; before issue #32 the engine picked the servers' own URLs and bypassed it)."""
    from fake_backend import make_ctx
    from transformers import AutoTokenizer

    from megatron_acrl.rollout.engine import GenerationEngine, PromptSource
    from megatron_acrl.rollout.group_queue import GroupQueue

    router = routed.router
    assert router is not None
    routed.update_weights(_weights(tiny_ckpt, 1.0).items(), "step-0")  # a version of the run's sequence
    sent_to: list[str] = []

    class Recording:
        """``routed``, noting where each async request's samples came from."""

        def __getattr__(self, name: str) -> object:
            return getattr(routed, name)

        def generate_async(self, prompt_ids: Any, params: Any) -> Any:
            sent = routed.generate_async(prompt_ids, params)
            sent.add_done_callback(
                lambda f: (
                    sent_to.extend(s.server for s in f.result())
                    if not f.cancelled() and f.exception() is None
                    else None
                )
            )
            return sent

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_ckpt))
    ctx = make_ctx(Recording(), ["rollout.mode=async"], tokenizer=tokenizer)
    assert ctx.prompt_stream is not None
    engine = GenerationEngine(
        ctx, GroupQueue(batch_groups=2, max_staleness=1), PromptSource(ctx.prompt_stream, 0, 0, []), 0
    )
    engine.start()
    try:
        kind, taken = engine.wait_batch(0)
    finally:
        engine.close()
    assert kind == "ok" and len(taken.groups) == 2
    assert sent_to and set(sent_to) == {router.url}
    assert set(router.workers()) == set(routed.urls)  # the router spread them over its servers
