"""Adapter-only weight sync on a real SGLang CPU server (``--enable-lora``, torch_native backend, the
``lora_cpu`` patch): one LoRA server shared by the module's tests (the recovery test starts its own
through the run's handle, which it kills).

* an adapter pushed as a PEFT file on tmpfs (``/load_lora_adapter``, servers on this host) serves the
  same log-probs as the merged weights W + (alpha / r) B A pushed through today's full update (the
  layout proof's tolerance), and as the same adapter sent as a ``flattened_bucket`` payload
  (``/load_lora_adapter_from_tensors``, servers on other hosts);
* a bad adapter is refused by the validator before any POST, and the server still serves;
* a version loaded while a request of the old one runs: the request keeps the old adapter, the old
  version is retired only once it ended;
* a server killed and restarted by the run's handle gets the current adapter back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from bridge_helpers import PROMPTS
from safetensors.torch import load_file
from test_lora_units import ALL, make_adapter, merged

from megatron_acrl.config import load_config
from megatron_acrl.config.model import LoraConfig
from megatron_acrl.servers.dispatch import Dispatch
from megatron_acrl.servers.handle import RolloutServers
from megatron_acrl.servers.lora_sync import AdapterMismatchError, AdapterSync, LoraManifest, adapter_config
from megatron_acrl.servers.publisher import WeightPublisher
from sglang_bridge.client import SamplingParams, SGLangClient
from sglang_bridge.server import ServerGroup, ServerSpec, SGLangServer
from sglang_bridge.server_spec import LoraServing
from sglang_bridge.weight_sync import DistributedWeightSynchronizer, Manifest

RANK, ALPHA = 8, 16.0
TOL = 1e-2
"""The layout proof's tolerance on the tiny bf16 model (tests/bridge/test_weight_sync.py)."""

SEQS = [p + [11, 12, 13, 14, 15, 16] for p in PROMPTS]
TARGETS = [6] * len(SEQS)


@pytest.fixture(scope="module")
def lora_server(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    lora = LoraServing(max_rank=16, target_modules=ALL, max_loras_per_batch=4)
    spec = ServerSpec(model_path=str(tiny_ckpt), device="cpu", lora=lora)
    with ServerGroup([spec], log_dir=tmp_path_factory.mktemp("lora-logs"), startup_timeout_s=600) as group:
        yield group.servers[0]


@pytest.fixture(scope="module")
def lm(tiny_ckpt: Path) -> LoraManifest:
    return LoraManifest.from_manifest(Manifest.from_checkpoint(tiny_ckpt), ALL, max_rank=16)


@pytest.fixture(scope="module")
def adapters(lora_server: SGLangServer, lm: LoraManifest) -> Iterator[AdapterSync]:
    config = adapter_config(LoraConfig(rank=RANK, alpha=ALPHA))
    sync = AdapterSync([lora_server.url], lm, config, timeout_s=120, background=False)
    yield sync
    sync.close()


def score(url: str, lora_path: str | None) -> torch.Tensor:
    async def run() -> list[list[float]]:
        async with SGLangClient(url) as c:
            return await c.score(SEQS, TARGETS, lora_path=lora_path)

    return torch.tensor(asyncio.run(run()))


def served_adapters(url: str) -> set[str]:
    models = requests.get(url + "/v1/models", timeout=30).json()["data"]
    return {m["id"] for m in models if str(m["id"]).startswith("policy@")}


def test_an_adapter_push_serves_what_the_merged_weights_serve(
    lora_server: SGLangServer, adapters: AdapterSync, lm: LoraManifest, tiny_ckpt: Path
) -> None:
    url = lora_server.url
    adapter = make_adapter(lm, RANK, seed=1)
    base = score(url, None)
    m = adapters.push(adapter, "step-1")
    assert m["sync/adapter_rank"] == RANK and "policy@v1" in served_adapters(url)
    served = score(url, "policy@v1")
    assert (served - base).abs().max() > 0.1  # the adapter moves the log-probs
    assert adapters.transport == "disk"
    remote = AdapterSync([url], lm, adapters.config, timeout_s=120, background=False, transport="tensors")
    try:
        remote.push(adapter, "tensors-1")
        assert float((score(url, "policy@tensors-1") - served).abs().max()) < 1e-4  # the same bf16 values
    finally:
        remote.close()
        requests.post(url + "/unload_lora_adapter", json={"lora_name": "policy@tensors-1"}, timeout=120)

    manifest = Manifest.from_checkpoint(tiny_ckpt)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(tiny_ckpt.glob("*.safetensors")):
        weights.update({k: v for k, v in load_file(str(f)).items() if k in manifest.tensors})
    sync = DistributedWeightSynchronizer([url], manifest, timeout_s=120)
    sync.connect()
    try:
        sync.sync(merged(weights, adapter, ALPHA), "merged")
        oracle = score(url, None)  # the base path now holds W + (alpha / r) B A
        sync.sync(weights, "base")  # the other tests ride on the checkpoint's base
    finally:
        sync.close()
    delta = float((served - oracle).abs().max())
    print(f"adapter-served vs merged-served max |dlogp| = {delta:.2e}")
    assert delta < TOL
    assert float((score(url, None) - base).abs().max()) < TOL  # base restored


def test_a_bad_adapter_is_refused_before_any_post(
    lora_server: SGLangServer, adapters: AdapterSync, lm: LoraManifest
) -> None:
    posts: list[str] = []
    real = adapters._post

    def spy(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        posts.append(path)
        return real(url, path, body)

    adapters._post = spy  # type: ignore[method-assign]
    try:
        bad_name = make_adapter(lm, RANK, seed=2)
        a = bad_name.pop("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight")
        bad_name["decoder.layers.0.mlp.linear_fc2.lora_A.weight"] = a  # the name that kills 0.5.23
        with pytest.raises(AdapterMismatchError, match="not a PEFT name"):
            adapters.push(bad_name, "step-9")
        bad_shape = make_adapter(lm, RANK, seed=2)
        key = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
        bad_shape[key] = bad_shape[key][:16]
        with pytest.raises(AdapterMismatchError, match=r"shape \(16, 8\), want \[out, r\] = \[32, r\]"):
            adapters.push(bad_shape, "step-9")
    finally:
        adapters._post = real  # type: ignore[method-assign]
    assert posts == [] and "policy@v9" not in served_adapters(lora_server.url)
    assert lora_server.alive() and score(lora_server.url, adapters.current).shape == (len(SEQS), 6)


@pytest.mark.slow  # two adapter versions with requests in flight (~50 s)
def test_a_new_version_loads_while_the_old_serves_and_retires_after(
    lora_server: SGLangServer, adapters: AdapterSync, lm: LoraManifest
) -> None:
    url = lora_server.url
    adapters.push(make_adapter(lm, RANK, seed=3), "step-3")
    adapters.retire_now()  # the earlier tests' versions: nothing in flight names them
    assert served_adapters(url) == {"policy@v3"}
    params = SamplingParams(temperature=1.0, max_new_tokens=480, ignore_eos=True, seed=None)
    dispatch = Dispatch(lambda u, cap: SGLangClient(u, max_concurrency=cap, timeout_s=600), adapters)

    async def run() -> tuple[list[Any], int, int]:
        fut = dispatch.send([url], [PROMPTS[0], PROMPTS[1]], params, cap=4)
        await asyncio.sleep(0.5)
        await asyncio.to_thread(adapters.push, make_adapter(lm, RANK, seed=4), "step-4")
        in_flight = adapters.outstanding.get("policy@v3", 0)
        retired = await asyncio.to_thread(adapters.retire_now)  # v3 still named: kept
        samples = await fut
        await dispatch.aclose()
        return samples, in_flight, retired

    samples, in_flight, retired = asyncio.run(run())
    assert in_flight == 1 and retired == 0, "the request ended before v4 was loaded: lengthen it"
    assert [s.weight_version for s in samples] == ["step-3", "step-3"]
    assert all(s.weight_versions == [{"version": "step-3", "start": 0, "end": 480}] for s in samples)
    # Every token came from v3 (the adapter the request acquired), none from v4 loaded meanwhile:
    # sampled log-probs of output tokens 300-399 (sampled well after v4 was loaded) against both
    # adapters' teacher-forced scoring of the ~400-token sequences. (This rescoring once came back
    # "malformed": SGLang echoes the last vocabulary id as 0, see sglang_bridge.samples.target_logprobs.)
    seqs = [s.prompt_ids + s.output_ids[:400] for s in samples]

    async def rescore(name: str) -> list[list[float]]:
        async with SGLangClient(url) as c:
            return await c.score(seqs, [100, 100], lora_path=name)

    got = torch.tensor([s.rollout_logprobs[300:400] for s in samples])
    v3, v4 = (torch.tensor(asyncio.run(rescore(n))) for n in ("policy@v3", "policy@v4"))
    own, other = (got - v3).abs(), (got - v4).abs()
    print(f"sampled vs v3 / v4 mean |dlogp|: {float(own.mean()):.2e} / {float(other.mean()):.2e}")
    assert float(own.mean()) < TOL / 2 and float(own.max()) < 0.1
    assert float(other.mean()) > 5 * float(own.mean())
    assert adapters.retire_now() == 1
    assert served_adapters(url) == {"policy@v4"} and adapters.live() == {"policy@v4"}


class AdapterPolicy:
    def __init__(self, adapter: dict[str, torch.Tensor]) -> None:
        self.adapter = adapter

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return self.adapter


def test_long_sequences_holding_the_last_vocab_id_score_on_an_adapter(
    lora_server: SGLangServer, adapters: AdapterSync, lm: LoraManifest, tiny_ckpt: Path
) -> None:
    # SGLang echoes id vocab_size - 1 as 0 in input_token_logprobs; its log-prob is the real
    # token's: checked against the same server's per-id log-prob of that token (token_ids_logprob)
    url, top = (
        lora_server.url,
        int(Manifest.from_checkpoint(tiny_ckpt).tensors["model.embed_tokens.weight"].shape[0]) - 1,
    )
    adapters.push(make_adapter(lm, RANK, seed=6), "step-6")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, top, (407,), generator=g) for _ in range(2)]
    for s in seqs:
        s[[50, 200, 300, 406]] = top
    seqs_l = [s.tolist() for s in seqs]

    async def run() -> list[list[float]]:
        async with SGLangClient(url) as c:
            return await c.score(seqs_l, [400, 400], lora_path="policy@v6")

    got = torch.tensor(asyncio.run(run()))
    body = {
        "input_ids": seqs_l,
        "sampling_params": [{"max_new_tokens": 0}] * 2,
        "return_logprob": True,
        "logprob_start_len": [6, 6],
        "token_ids_logprob": [[top], [top]],
        "lora_path": "policy@v6",
    }
    outs = requests.post(url + "/generate", json=body, timeout=300).json()
    for i, o in enumerate(outs):
        per_id = o["meta_info"]["input_token_ids_logprobs"]
        for p in (50, 200, 300, 406):
            assert abs(float(got[i, p - 7]) - per_id[p - 6][0][0]) < 1e-3  # same forward, other batch
    assert got.shape == (2, 400)


@pytest.mark.slow  # starts and restarts its own server (~40 s)
def test_a_restarted_server_gets_the_adapter_back(tiny_ckpt: Path, lm: LoraManifest, tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            f"model.lora.rank={RANK}",
            f"model.lora.alpha={ALPHA}",
            "rollout.startup_timeout_s=600",
            "rollout.weight_sync_timeout_s=120",
            "rollout.weight_sync=rank0",
        ],
    )
    servers = RolloutServers(cfg, tiny_ckpt, tmp_path / "logs")
    try:
        pub = WeightPublisher(cfg, 0, AdapterPolicy(make_adapter(lm, RANK, seed=5)), servers)
        pub.push("step-5")
        before = torch.tensor(servers.score(SEQS, TARGETS))
        s = servers.servers[0]
        os.kill(s.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while s.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        m = pub.push("step-5")  # the handle restarts the dead server and loads the adapter on it
        assert servers.restarts == 1 and m["sync/adapter"] == 1.0 and servers.servers[0].pid != s.pid
        after = torch.tensor(servers.score(SEQS, TARGETS))
        assert float((after - before).abs().max()) < TOL
        samples = servers.generate([PROMPTS[0]], 2, servers.sampling_params())[0]
        assert {x.meta["adapter"] for x in samples} == {"policy@v5"}
        assert {x.weight_version for x in samples} == {"step-5"}
    finally:
        servers.close()
