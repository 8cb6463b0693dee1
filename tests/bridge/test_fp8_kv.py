"""FP8 (e4m3) KV cache: SGLang's own on cuda, emulated on a CPU server (``rollout.kv_cache_dtype``).

* The patch itself (``cpu_compat/hooks/sitecustomize.py: fp8_kv``) on a stand-in pool: every K and V
  reaches the cache rounded through e4m3, saturating at +-448, the rest of the call unchanged.
* The launch plumbing: cpu gets the hook (and no SGLang flag), cuda the real ``--kv-cache-dtype``.
* A real CPU server with the emulated cache: its log-probs move away from the bf16-cache server's, and
  they are closer to an independent transformers forward whose attention reads e4m3-rounded K and V
  than to the plain forward.
"""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

import httpx
import pytest
import torch
from bridge_helpers import load_hf

from megatron_acrl.config import load_config
from sglang_bridge.cpu_compat import CPU_HOOK_DIR, HOOKS_ENV, STAND_IN_DIR
from sglang_bridge.server import ServerSpec, SGLangServer

SEQS = [torch.randint(5, 300, (40,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(6)]


def _hooks_module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("acrl_test_hooks", CPU_HOOK_DIR / "sitecustomize.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    old = os.environ.pop(HOOKS_ENV, None)
    try:
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    finally:
        if old is not None:
            os.environ[HOOKS_ENV] = old
    return mod


def test_patch_rounds_k_and_v_through_e4m3():
    hooks = _hooks_module()
    seen = {}

    class Pool:
        def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None):
            seen.update(layer=layer, loc=loc, k=cache_k, v=cache_v, scales=(k_scale, v_scale))

    fake = types.SimpleNamespace(MHATokenToKVPool=Pool)
    hooks._patch_fp8_kv(fake)
    k = torch.tensor([[0.3, -1.7, 1000.0, 1e-4]], dtype=torch.bfloat16)
    v = torch.tensor([[-0.05, 2.9, -600.0, 0.0]], dtype=torch.bfloat16)
    Pool().set_kv_buffer("L", "loc", k, v, 1.0, v_scale=2.0)
    assert seen["layer"] == "L" and seen["loc"] == "loc" and seen["scales"] == (1.0, 2.0)
    for got, x in ((seen["k"], k), (seen["v"], v)):
        assert got.dtype == torch.bfloat16
        want = x.float().clamp(-448, 448).to(torch.float8_e4m3fn).float()
        torch.testing.assert_close(got.float(), want, rtol=0, atol=0)
    assert seen["k"][0, 2].item() == 448.0 and seen["v"][0, 2].item() == -448.0  # saturates
    assert seen["k"][0, 0].item() == 0.3125  # on the e4m3 grid


def test_launch_plumbing():
    cpu = ServerSpec(model_path="m", device="cpu", kv_cache_dtype="fp8_e4m3")
    env = cpu.env()
    assert env[HOOKS_ENV] == "fp8_kv,paused_sleep,bound_stores"
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(CPU_HOOK_DIR), str(STAND_IN_DIR)]
    assert "--kv-cache-dtype" not in cpu.command(1234)
    both = ServerSpec(model_path="m", device="cpu", kv_cache_dtype="fp8_e4m3", return_routed_experts=True)
    assert both.env()[HOOKS_ENV] == "r3_alloc,fp8_kv,paused_sleep,bound_stores"
    plain = ServerSpec(model_path="m", device="cpu")  # every CPU server sleeps while paused
    assert plain.env()[HOOKS_ENV] == "paused_sleep,bound_stores"
    assert plain.env()["PYTHONPATH"].split(os.pathsep)[0] == str(CPU_HOOK_DIR)
    gpu = ServerSpec(model_path="m", device="cuda", kv_cache_dtype="fp8_e4m3")
    cmd = gpu.command(1234)
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and gpu.env()[HOOKS_ENV] == "bound_stores"
    cfg = load_config(
        Path(__file__).resolve().parents[2] / "configs" / "demo.yaml", ["rollout.kv_cache_dtype=fp8_e4m3"]
    )
    assert cfg.rollout.kv_cache_dtype == "fp8_e4m3"


def _score(url: str) -> torch.Tensor:
    """``[len(SEQS), 39]`` log-probs of each sequence's own next tokens (prefill only)."""
    rows = []
    for s in SEQS:
        body = {
            "input_ids": s,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        mi = httpx.post(url + "/generate", json=body, timeout=300).json()["meta_info"]
        rows.append([x[0] for x in mi["input_token_logprobs"][1:]])
    return torch.tensor(rows)


@torch.no_grad()
def _hf_score(model: torch.nn.Module) -> torch.Tensor:
    rows = []
    for s in SEQS:
        lp = torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1)
        rows.append([lp[i, s[i + 1]].item() for i in range(len(s) - 1)])
    return torch.tensor(rows)


@pytest.mark.slow  # starts its own FP8-KV server (~20 s)
def test_emulated_fp8_kv_server(sglang_server: SGLangServer, tiny_ckpt: Path, tmp_path: Path):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    spec = ServerSpec(model_path=str(tiny_ckpt), device="cpu", kv_cache_dtype="fp8_e4m3")
    with SGLangServer(spec, tmp_path / "fp8kv.log", startup_timeout_s=600) as fp8kv:
        got = _score(fp8kv.url)
    bf16 = _score(sglang_server.url)

    def e4m3_kv_sdpa(module, query, key, value, *args, **kwargs):  # noqa: ANN001, ANN202
        r = lambda x: x.clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)  # noqa: E731
        return sdpa_attention_forward(module, query, r(key), r(value), *args, **kwargs)

    AttentionInterface.register("acrl_test_e4m3_kv", e4m3_kv_sdpa)
    model = load_hf(tiny_ckpt)
    plain = _hf_score(model)
    model.set_attn_implementation("acrl_test_e4m3_kv")
    ref = _hf_score(model)
    gap_bf16, gap_plain, gap_ref = ((got - x).abs().mean().item() for x in (bf16, plain, ref))
    print(f"fp8-KV server vs bf16-KV {gap_bf16:.5f}, HF plain {gap_plain:.5f}, HF e4m3-KV {gap_ref:.5f}")
    assert (got - bf16).abs().max().item() > 1e-3  # the emulation is on in the real server
    assert gap_ref < gap_plain  # and it is the FP8 KV cache that moved the log-probs
