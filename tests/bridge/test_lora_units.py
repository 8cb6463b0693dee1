"""Adapter-only weight sync without a server (:mod:`megatron_acrl.servers.lora_sync`): the validator
against the served model, version names, the dispatch's adapter per request, the retirement rule,
the publisher in ``sync: adapter`` mode, the LoRA launch flags and the CPU pin-memory patch. The
real server's side is ``tests/bridge/test_lora_server.py``; ``make_adapter`` / ``merged`` are shared
with it."""

from __future__ import annotations

import asyncio
import base64
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_acrl.batch.staleness import token_versions
from megatron_acrl.config import load_config
from megatron_acrl.config.model import LoraConfig
from megatron_acrl.servers.dispatch import Dispatch
from megatron_acrl.servers.lora_payload import all_finite, flat_payload, pack, serialize
from megatron_acrl.servers.lora_sync import (
    PEFT_PREFIX,
    AdapterMismatchError,
    AdapterSync,
    LoraManifest,
    adapter_config,
    adapter_label,
    adapter_name,
    served_modules,
)
from megatron_acrl.servers.publisher import WeightPublisher
from megatron_acrl.servers.transfer import RESTART
from sglang_bridge.client import Sample, SamplingParams, ServerGoneError
from sglang_bridge.cpu_compat import CPU_HOOK_DIR, HOOKS_ENV
from sglang_bridge.samples import target_logprobs
from sglang_bridge.server_spec import LoraServing, ServerSpec
from sglang_bridge.transport import SGLangHTTPError
from sglang_bridge.weight_sync import Manifest
from sglang_bridge.weight_sync.manifest import TensorSpec

ALL = served_modules(LoraConfig())


def make_adapter(lm: LoraManifest, rank: int, seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A PEFT adapter for every module of ``lm``: A [r, in] and B [out, r], both random (B nonzero,
    so the adapter changes the outputs), fp32."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for mod, (o, i) in lm.modules.items():
        out[f"{PEFT_PREFIX}{mod}.lora_A.weight"] = torch.randn(rank, i, generator=g) * scale
        out[f"{PEFT_PREFIX}{mod}.lora_B.weight"] = torch.randn(o, rank, generator=g) * scale
    return out


def merged(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """``base`` with every adapted weight replaced by W + (alpha / r) B A (fp32 sum, base dtype)."""
    out = dict(base)
    for name, a in adapter.items():
        if not name.endswith(".lora_A.weight"):
            continue
        mod = name[len(PEFT_PREFIX) : -len(".lora_A.weight")]
        b = adapter[f"{PEFT_PREFIX}{mod}.lora_B.weight"]
        w = base[f"{mod}.weight"]
        out[f"{mod}.weight"] = (w.float() + alpha / a.shape[0] * (b.float() @ a.float())).to(w.dtype)
    return out


@pytest.fixture(scope="module")
def lm(tiny_ckpt: Path) -> LoraManifest:
    return LoraManifest.from_manifest(Manifest.from_checkpoint(tiny_ckpt), ALL, max_rank=16)


# -- the validator -----------------------------------------------------------------------------


def test_the_manifest_holds_every_layers_target_modules_with_their_shapes(lm: LoraManifest) -> None:
    # the tiny model: 2 layers, hidden 64, 4 heads of 16 (2 KV groups), SwiGLU 128
    assert len(lm.modules) == 2 * 7
    assert lm.modules["model.layers.1.self_attn.k_proj"] == (32, 64)
    assert lm.modules["model.layers.0.mlp.down_proj"] == (64, 128)
    assert lm.check(make_adapter(lm, 8)) == 8


def _break(adapter: dict[str, torch.Tensor], how: str) -> dict[str, torch.Tensor]:
    a = dict(adapter)
    key = f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight"
    if how == "megatron name":
        a["decoder.layers.0.mlp.linear_fc2.lora_A.weight"] = a.pop(key)
    elif how == "typo":
        a[key.replace("q_proj", "qproj")] = a.pop(key)
    elif how == "missing":
        del a[key.replace("lora_A", "lora_B").replace("q_proj", "v_proj")]
    elif how == "transposed":
        a[key] = a[key].t().contiguous()
    elif how == "mixed rank":
        a[key] = a[key][:4]
    elif how == "nan":
        a[key] = a[key].clone()
        a[key][0, 0] = float("nan")
    elif how == "integer":
        a[key] = a[key].to(torch.int32)
    return a


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("megatron name", "decoder.layers.0.mlp.linear_fc2.lora_A.weight: not a PEFT name"),
        ("typo", "did you mean base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
        ("missing", "1 factor(s) missing"),
        ("transposed", "shape (64, 8), want [r, in] = [r, 64]"),
        ("mixed rank", "mixed ranks [4, 8]"),
        ("nan", "holds inf or nan"),
        ("integer", "want a floating dtype"),
    ],
)
def test_an_adapter_that_would_kill_the_server_is_refused_naming_why(
    lm: LoraManifest, how: str, message: str
) -> None:
    with pytest.raises(AdapterMismatchError, match="refused before any POST") as e:
        lm.check(_break(make_adapter(lm, 8), how))
    assert message in str(e.value)


def test_a_rank_above_the_servers_max_is_refused(lm: LoraManifest) -> None:
    with pytest.raises(AdapterMismatchError, match=r"rank 32 > the servers' --max-lora-rank 16"):
        lm.check(make_adapter(lm, 32))


def test_lora_on_moe_experts_asks_for_merged_sync() -> None:
    experts = Manifest(
        {"model.layers.0.mlp.experts.0.down_proj.weight": TensorSpec((64, 32), torch.bfloat16)}
    )
    with pytest.raises(ValueError, match="sync=merged"):
        LoraManifest.from_manifest(experts, ("down_proj",), 8)


# -- names, stamps, payloads, config ---------------------------------------------------------------


def test_the_name_is_the_version_and_every_token_carries_it() -> None:
    assert adapter_name("step-3") == "policy@v3" and adapter_label("policy@v3") == "step-3"
    assert adapter_name("eval") == "policy@eval" and adapter_label("policy@eval") == "eval"
    from megatron_acrl.servers.lora_sync import stamp

    s = Sample([1], [5, 6, 7], [-0.1] * 3, "stop", "default", [{"version": "default", "start": 0, "end": 3}])
    stamp([s], "policy@v3")
    assert (
        s.meta["adapter"] == "policy@v3" and token_versions(3, s.weight_version, s.weight_versions) == [3] * 3
    )


def test_a_payload_is_a_plain_pickle_in_the_servers_dtype(lm: LoraManifest) -> None:
    adapter = make_adapter(lm, 4)
    back = pickle.loads(base64.b64decode(serialize(adapter, torch.bfloat16)))
    assert back.keys() == adapter.keys()
    assert all(
        back[k].dtype == torch.bfloat16 and torch.equal(back[k], v.bfloat16()) for k, v in adapter.items()
    )


def test_a_flattened_bucket_payload_is_what_sglangs_safe_unpickler_rebuilds(lm: LoraManifest) -> None:
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    adapter = make_adapter(lm, 4)
    data = MultiprocessingSerializer.deserialize(flat_payload(pack(adapter, torch.bfloat16)))
    bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    back = dict(
        bucket.reconstruct_tensors()
    )  # what SGLang's tp worker does with load_format flattened_bucket
    assert list(back) == list(adapter)
    assert all(torch.equal(back[k], v.bfloat16()) for k, v in adapter.items())


def test_the_finite_check_reads_the_exponent_bits() -> None:
    x = torch.randn(1000)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert all_finite(x.to(dtype))
        for bad in (float("inf"), float("-inf"), float("nan")):
            y = x.clone()
            y[537] = bad
            assert not all_finite(y.to(dtype)), (dtype, bad)
    assert not all_finite(torch.tensor([1e39]).to(torch.float16))  # overflows the dtype: inf


def test_scoring_accepts_sglangs_zeroed_echo_of_the_last_vocab_id() -> None:
    # SGLang 0.5.23 echoes id vocab_size - 1 as 0 (its log-prob is the real token's): measured on a
    # LoRA server, the cause of the "malformed" rescoring of long sampled sequences
    seq = [5, 319, 7, 319, 9]
    out = {
        "meta_info": {
            "input_token_logprobs": [
                [None, 5, None],
                [-1.0, 0, None],
                [-2.0, 7, None],
                [-3.0, 0, None],
                [-4.0, 9, None],
            ]
        }
    }
    assert target_logprobs(out, seq, 4, "u") == [-1.0, -2.0, -3.0, -4.0]
    shifted = {
        "meta_info": {
            "input_token_logprobs": [
                [None, 0, None],
                [-1.0, 5, None],
                [-2.0, 0, None],
                [-3.0, 7, None],
                [-4.0, 0, None],
            ]
        }
    }
    with pytest.raises(SGLangHTTPError):
        target_logprobs(shifted, seq, 4, "u")
    with pytest.raises(SGLangHTTPError):  # 0 for an id that is not the sequence's largest
        target_logprobs(out, [5, 319, 7, 320, 9], 4, "u")
    wrong = {
        "meta_info": {
            "input_token_logprobs": [
                e if i != 3 else [-3.0, 8, None]
                for i, e in enumerate(out["meta_info"]["input_token_logprobs"])
            ]
        }
    }
    with pytest.raises(SGLangHTTPError):  # another id where the largest is expected: not an echo
        target_logprobs(wrong, seq, 4, "u")


def test_a_peft_export_of_moe_expert_adapters_is_refused_naming_the_fix(tmp_path: Path) -> None:
    from megatron_acrl.megatron import lora

    state = {f"{PEFT_PREFIX}model.layers.0.mlp.experts.3.gate_proj.lora_A.weight": torch.zeros(4, 8)}
    with pytest.raises(ValueError, match=r"model.lora.target_modules.*--export-hf-merged"):
        lora.write_peft_dir(state, {}, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_the_adapter_config_is_plain_lora_over_the_hf_modules() -> None:
    c = adapter_config(LoraConfig(rank=8, alpha=16.0, target_modules=("linear_qkv",)), "/m")
    assert c["target_modules"] == ["q_proj", "k_proj", "v_proj"] and c["lora_alpha"] == 16.0
    assert c["r"] == 8 and not c["use_rslora"] and not c["use_dora"] and c["base_model_name_or_path"] == "/m"


def test_a_lora_server_gets_the_flags_and_on_cpu_the_pin_memory_patch() -> None:
    lora = LoraServing(max_rank=16, target_modules=("q_proj", "o_proj"), max_loras_per_batch=4)
    cpu = ServerSpec(model_path="m", device="cpu", lora=lora)
    cmd = cpu.command(1)
    i = cmd.index("--enable-lora")
    assert cmd[i:] == [
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--lora-target-modules",
        "q_proj",
        "o_proj",
        "--lora-backend",
        "torch_native",
        "--max-loras-per-batch",
        "4",
    ]
    assert "lora_cpu" in cpu.env()[HOOKS_ENV].split(",")
    assert "lora_cpu" not in ServerSpec(model_path="m", device="cpu").env()[HOOKS_ENV].split(",")
    assert ServerSpec(model_path="m", device="cuda", lora=lora).env()[HOOKS_ENV] == "bound_stores"
    with pytest.raises(ValueError, match="max_loras_per_batch >= 2"):
        LoraServing(max_rank=8, target_modules=("q_proj",), max_loras_per_batch=1)


def test_the_pin_memory_patch_in_a_child(tmp_path: Path) -> None:
    """``lora_cpu`` on a stand-in ``sglang.srt.lora.layers`` (the real one: the server tests)."""
    pkg = tmp_path / "sglang" / "srt" / "lora"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "layers.py").write_text("import torch\n")
    code = (
        "import sglang.srt.lora.layers, torch\n"
        "x = torch.empty((2, 3), dtype=torch.int32, pin_memory=True)\n"
        "y = torch.tensor([1, 2], pin_memory=True, device='cpu')\n"
        "z = torch.zeros(4)\n"
        "print(tuple(x.shape), y.tolist(), z.pin_memory() is z)\n"
    )
    env = {"PYTHONPATH": f"{CPU_HOOK_DIR}:{tmp_path}", HOOKS_ENV: "lora_cpu", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "(2, 3) [1, 2] True"
    env[HOOKS_ENV] = "paused_sleep"  # without it a CPU torch refuses to pin
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "pin_memory" in out.stderr


# -- AdapterSync without a server ----------------------------------------------------------------


class Posts:
    """Stands in for the servers' HTTP: records every POST, answers success (or raises ``fail``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.fail: BaseException | None = None

    def __call__(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((url, path, body["lora_name"]))
        if self.fail is not None and path == "/unload_lora_adapter":
            raise self.fail
        return {"success": True}


@pytest.fixture()
def sync(lm: LoraManifest) -> Any:
    config = adapter_config(LoraConfig(rank=8))
    s = AdapterSync(["http://a", "http://b"], lm, config, server_tp=2, background=False)
    s._post = Posts()  # type: ignore[method-assign]
    yield s
    s.close()


def test_a_version_retires_only_when_no_request_names_it(sync: AdapterSync, lm: LoraManifest) -> None:
    m = sync.push(make_adapter(lm, 8), "step-1")
    assert m["sync/bytes"] == sum(t.numel() for t in make_adapter(lm, 8).values()) * 2  # bf16
    held = sync.acquire()  # a request sent under v1 is still running
    sync.push(make_adapter(lm, 8, seed=1), "step-2")
    assert held == "policy@v1" and sync.current == "policy@v2"
    assert sync.retire_now() == 0 and sync.live() == {"policy@v1", "policy@v2"}
    sync.paused = True
    sync.release(held)
    assert sync.retire_now() == 0  # paused: an unload would wait on retracted requests
    sync.paused = False
    assert sync.retire_now() == 1 and sync.live() == {"policy@v2"}
    unloads = [c for c in sync._post.calls if c[1] == "/unload_lora_adapter"]  # type: ignore[attr-defined]
    assert sorted(unloads) == [
        ("http://a", "/unload_lora_adapter", "policy@v1"),
        ("http://b", "/unload_lora_adapter", "policy@v1"),
    ]


def test_a_refused_adapter_posts_nothing(sync: AdapterSync, lm: LoraManifest) -> None:
    with pytest.raises(AdapterMismatchError):
        sync.push(_break(make_adapter(lm, 8), "megatron name"), "step-1")
    assert sync._post.calls == [] and sync.current is None  # type: ignore[attr-defined]


def test_a_hung_unload_fails_the_next_push_until_the_recovery_replaces_the_server(
    sync: AdapterSync, lm: LoraManifest
) -> None:
    sync.push(make_adapter(lm, 8), "step-1")
    sync._post.fail = TimeoutError("no answer")  # type: ignore[attr-defined]
    sync.push(make_adapter(lm, 8), "step-2")
    sync.retire_now()
    with pytest.raises(TimeoutError, match="unload on http://a never ended"):
        sync.push(make_adapter(lm, 8), "step-3")
    sync._post.fail = None  # type: ignore[attr-defined]
    sync.servers_changed(["http://a", "http://c"], restarted=True)  # the recovery replaced them
    sync._post.calls.clear()  # type: ignore[attr-defined]
    sync.push(make_adapter(lm, 8), "step-3")
    loads = {c[0] for c in sync._post.calls if c[1] == "/load_lora_adapter_from_tensors"}  # type: ignore[attr-defined]
    assert loads == {"http://a", "http://c"}  # every server, the survivors too (already there: fine)


def test_local_servers_load_a_peft_dir_from_tmpfs_removed_after(lm: LoraManifest) -> None:
    from safetensors.torch import load_file

    adapter, seen = make_adapter(lm, 8), []
    s = AdapterSync(["http://127.0.0.1:1"], lm, adapter_config(LoraConfig(rank=8)), background=False)

    def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        d = Path(body["lora_path"])
        seen.append(
            (
                path,
                d,
                load_file(str(d / "adapter_model.safetensors")),
                (d / "adapter_config.json").read_text(),
            )
        )
        return {"success": True}

    s._post = post  # type: ignore[method-assign]
    try:
        assert s.transport == "disk"
        m = s.push(adapter, "step-1")
        [(path, d, tensors, config)] = seen
        assert path == "/load_lora_adapter" and d.name == "policy@v1" and m["sync/adapter_disk"] == 1.0
        assert '"r": 8' in config and not d.exists()  # read by the server during the load, then removed
        assert all(torch.equal(tensors[k], v.bfloat16()) for k, v in adapter.items())
        bad = dict(adapter)
        bad[next(iter(bad))] = bad[next(iter(bad))].clone().fill_(float("nan"))
        with pytest.raises(AdapterMismatchError, match="holds inf or nan"):
            s.push(bad, "step-2")
        assert len(seen) == 1
    finally:
        s.close()
    with pytest.raises(ValueError, match="transport='tensors'"):
        AdapterSync(["http://10.0.0.7:30000"], lm, {}, background=False, transport="disk")


# -- the dispatch names the current adapter --------------------------------------------------------


class Client:
    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[str | None] = []
        self.gate = asyncio.Event()

    async def generate_batch(self, prompts: Any, params: list[SamplingParams]) -> list[Sample]:
        self.seen.append(params[0].lora_path)
        await self.gate.wait()
        return [Sample(list(p), [9, 9], [-1.0, -1.0], "stop", "default") for p in prompts]

    async def generate_group(self, prompt: Any, params: SamplingParams, n: int) -> list[Sample]:
        self.seen.append(params.lora_path)
        return [Sample(list(prompt), [9], [-1.0], "stop", "default") for _ in range(n)]

    async def aclose(self) -> None:
        pass


def test_every_request_names_the_current_adapter_and_is_counted_until_it_ends(
    sync: AdapterSync, lm: LoraManifest
) -> None:
    clients: dict[str, Client] = {}
    dispatch = Dispatch(lambda url, cap: clients.setdefault(url, Client(url)), sync)

    async def run() -> tuple[list[Sample], list[list[Sample]]]:
        sync.push(make_adapter(lm, 8), "step-4")
        fut = dispatch.send(["http://a"], [[1, 2], [3]], SamplingParams(), cap=4)
        await asyncio.sleep(0)
        assert sync.outstanding == {"policy@v4": 2} or sync.outstanding == {"policy@v4": 1}
        sync.push(make_adapter(lm, 8), "step-5")  # the request in flight keeps v4
        clients["http://a"].gate.set()
        batch = await fut
        groups = (
            await dispatch.fan_out(["http://a"], [[7]], SamplingParams(), 2, cap=4, samples_per_request=None)
        ).groups
        return batch, groups

    batch, groups = asyncio.run(run())
    assert [s.weight_version for s in batch] == ["step-4", "step-4"]
    assert [s.weight_version for s in groups[0]] == ["step-5", "step-5"]
    assert clients["http://a"].seen == ["policy@v4", "policy@v5"]
    assert not any(sync.outstanding.values())


# -- the publisher in sync: adapter ------------------------------------------------------------------


class AdapterServers:
    def __init__(self, errors: list[BaseException] | None = None) -> None:
        self.errors = list(errors or [])
        self.pushed: list[tuple[str, float]] = []
        self.recovered: list[tuple[str, int]] = []
        self.dead: list[int] = []
        self.restarts = self.hung_restarts = 0

    def dead_servers(self) -> list[int]:
        return self.dead

    def update_adapter(self, adapter: dict[str, torch.Tensor], version: str) -> dict[str, float]:
        if self.errors:
            raise self.errors.pop(0)
        self.pushed.append((version, float(next(iter(adapter.values()))[0])))
        return {"sync/seconds": 0.01, "sync/adapter": 1.0}

    def update_weights(self, *a: Any, **k: Any) -> dict[str, float]:
        raise AssertionError("adapter sync never pushes the full weights")

    def recover(self, action: str, attempt: int) -> None:
        self.recovered.append((action, attempt))
        self.restarts += 1


class AdapterPolicy:
    def __init__(self) -> None:
        self.step = 0

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {"a": torch.full((1,), float(self.step))}

    def hf_weights(self, all_stages: bool = True) -> Any:
        raise AssertionError("adapter sync never walks the full weights")


def _adapter_publisher(servers: AdapterServers, lag: int = 0) -> WeightPublisher:
    cfg = load_config(
        None, ["model.lora.rank=8", f"rollout.weight_lag_steps={lag}", "rollout.weight_sync=rank0"]
    )
    return WeightPublisher(cfg, 0, AdapterPolicy(), servers)


def test_the_publisher_pushes_adapters_with_the_same_retries_and_lag() -> None:
    servers = AdapterServers([ServerGoneError("gone")])
    pub = _adapter_publisher(servers, lag=1)
    pub.start(0)
    for v in (1, 2, 3):
        pub.policy.step = v
        pub.publish(v)
    assert servers.recovered == [(RESTART, 0)]  # a server gone: restarted, the adapter pushed again
    assert servers.pushed == [("step-0", 0.0), ("step-1", 1.0), ("step-2", 2.0)]
    assert pub.held_bytes == 2 * 4  # the lag buffer holds adapters: two versions of one float


def test_a_refused_adapter_is_not_retried() -> None:
    servers = AdapterServers([AdapterMismatchError("adapter refused before any POST: x")])
    with pytest.raises(RuntimeError, match="failed: AdapterMismatchError"):
        _adapter_publisher(servers).push("step-1")
    assert servers.recovered == []


def test_a_cpu_servers_base_is_fake_quantized_once_on_disk(tiny_ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from megatron_acrl.servers.lora_sync import fake_quant_base
    from megatron_acrl.servers.transfer import fp8_scheme
    from sglang_bridge.fp8 import fake_quantize

    cfg = load_config(None, ["model.lora.rank=8", "rollout.quantization=fp8_per_channel"])
    dst = fake_quant_base(cfg, str(tiny_ckpt), tmp_path)
    assert fake_quant_base(cfg, str(tiny_ckpt), tmp_path) == dst and (dst / "config.json").exists()
    src = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    got = load_file(str(next(dst.glob("*.safetensors"))))
    name = "model.layers.0.self_attn.q_proj.weight"
    scheme = fp8_scheme(cfg)
    assert scheme is not None and torch.equal(got[name], fake_quantize(src[name], scheme))
    assert not torch.equal(got[name], src[name])
    assert torch.equal(got["model.embed_tokens.weight"], src["model.embed_tokens.weight"])


def test_adapter_sync_refuses_to_evaluate_unquantized_trainer_weights() -> None:
    from megatron_acrl.config import ConfigError
    from megatron_acrl.servers.lora_sync import check_adapter_sync

    cfg = load_config(None, ["model.lora.rank=8", "training.eval_trainer_weights=true"])
    with pytest.raises(ConfigError, match="model.lora.sync=merged"):
        check_adapter_sync(cfg)
    merged_sync = ["model.lora.rank=8", "model.lora.sync=merged", "training.eval_trainer_weights=true"]
    check_adapter_sync(load_config(None, merged_sync))  # merged: the full sync evaluates them
