"""Stress emulation of the rollout copy (the study's "truncated FP8"): rounding toward zero, fewer
mantissa bits, quantized MoE routers and lm_head. Checked against an exhaustive table of e4m3 codes."""

from __future__ import annotations

import pytest
import torch

from sglang_bridge.fp8 import (
    FP8_DTYPE,
    Fp8Scheme,
    fake_quantize,
    fake_quantize_named_stress,
    fake_quantize_stress,
    is_router,
    to_e4m3,
)

# Every finite non-negative e4m3fn value, ascending (codes 0..126; 127 is NaN).
CODES = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()


def _largest_code_le(a: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    idx = torch.searchsorted(grid, a, right=True) - 1
    return grid[idx.clamp(min=0)]


@pytest.mark.parametrize("mantissa_bits", [3, 2, 1, 0])
def test_toward_zero_is_the_largest_grid_value_not_above(mantissa_bits):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * s for s in (1e-3, 0.1, 10, 200)]).clamp(-448, 448)
    q = to_e4m3(x, "toward_zero", mantissa_bits).float()
    step = 2 ** (3 - mantissa_bits)
    # the e4mM grid: codes whose low (3 - M) mantissa bits are zero
    grid = CODES[(torch.arange(127) % step) == 0]
    expect = _largest_code_le(x.abs(), grid) * x.sign()
    assert torch.equal(q, expect)
    assert (q.abs() <= x.abs()).all()


def test_nearest_full_mantissa_is_the_plain_cast():
    x = torch.randn(1000) * 50
    assert torch.equal(to_e4m3(x).view(torch.uint8), x.to(FP8_DTYPE).view(torch.uint8))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="mantissa_bits"):
        to_e4m3(torch.ones(2), "nearest", 4)
    with pytest.raises(ValueError, match="rounding"):
        to_e4m3(torch.ones(2), "down")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "scheme", [Fp8Scheme("block", (32, 32)), Fp8Scheme("per_tensor"), Fp8Scheme("per_channel")]
)
def test_defaults_equal_fake_quantize_and_stress_is_biased(scheme):
    w = torch.randn(64, 96, dtype=torch.bfloat16) * 0.02
    assert torch.equal(fake_quantize_stress(w, scheme), fake_quantize(w, scheme))
    t = fake_quantize_stress(w, scheme, "toward_zero", 1)
    assert t.dtype == w.dtype and t.shape == w.shape
    assert (t.float().abs() <= w.float().abs()).all()  # truncation only ever shrinks
    err = ((t.float() - w.float()).abs().mean() / w.float().abs().mean()).item()
    near = ((fake_quantize(w, scheme).float() - w.float()).abs().mean() / w.float().abs().mean()).item()
    assert err > 3 * near


def test_named_stream_quantizes_routers_only_when_asked():
    gate = "model.layers.0.mlp.gate.weight"
    proj = "model.layers.0.mlp.experts.1.up_proj.weight"
    norm = "model.layers.0.input_layernorm.weight"
    tensors = [(n, torch.randn(8, 64, dtype=torch.bfloat16)) for n in (gate, proj)]
    tensors.append((norm, torch.randn(64, dtype=torch.bfloat16)))
    scheme = Fp8Scheme("per_tensor")
    assert is_router(gate) and not is_router(proj)
    plain = dict(fake_quantize_named_stress(tensors, scheme, "toward_zero", 1))
    routed = dict(fake_quantize_named_stress(tensors, scheme, "toward_zero", 1, quantize_router=True))
    src = dict(tensors)
    assert torch.equal(plain[gate], src[gate]) and not torch.equal(routed[gate], src[gate])
    assert torch.equal(plain[proj], routed[proj]) and not torch.equal(plain[proj], src[proj])
    assert torch.equal(plain[norm], src[norm]) and torch.equal(routed[norm], src[norm])


def test_named_stream_quantizes_the_lm_head_when_asked():
    """``also`` names weights FP8 recipes keep in bf16 (the study's lm_head, or the embedding table
    a tied model uses as its lm_head): quantized like the projections, the rest untouched."""
    emb, head, proj = "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight"
    tensors = [(n, torch.randn(32, 64, dtype=torch.bfloat16)) for n in (emb, head, proj)]
    scheme, src = Fp8Scheme("per_tensor"), dict(tensors)
    plain = dict(fake_quantize_named_stress(tensors, scheme, "toward_zero", 1))
    headed = dict(fake_quantize_named_stress(tensors, scheme, "toward_zero", 1, also=[head]))
    assert torch.equal(plain[head], src[head]) and torch.equal(plain[emb], src[emb])
    assert torch.equal(headed[head], fake_quantize_stress(src[head], scheme, "toward_zero", 1))
    assert torch.equal(headed[emb], src[emb]) and torch.equal(headed[proj], plain[proj])
