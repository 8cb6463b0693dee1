"""FP8 quantization: round trips, SGLang's own CPU dequantizer as the oracle, flattened FP8 over gloo."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from gloo_pair import gloo_group
from hypothesis import given, settings
from hypothesis import strategies as st

import ckernels as native
from sglang_bridge.cpu_compat import server_env
from sglang_bridge.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Kernel,
    Fp8Scheme,
    Fp8Workspace,
    dequantize_block,
    dequantize_scaled,
    fake_quantize,
    fake_quantize_block,
    fake_quantize_block_into,
    fake_quantize_stress,
    native_available,
    quantize_block,
    quantize_block_into,
    quantize_named_tensors,
    quantize_per_channel,
    quantize_per_tensor,
    scheme_from_config,
    should_quantize,
)
from sglang_bridge.fp8 import native as fp8_native
from sglang_bridge.fp8.block import _fake_quantize_block_reference, _quantize_block_reference
from sglang_bridge.server import free_port
from sglang_bridge.weight_sync import broadcast_async
from sglang_bridge.weight_sync.buckets import Bucket

SHAPES = [(256, 512), (300, 200), (64, 64), (129, 1)]


def _weights() -> dict[tuple[int, int], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {s: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for s in SHAPES}


@pytest.fixture(scope="module")
def sglang_oracle(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """SGLang's block_quant_dequant of our quantized weights and its own UE8M0 quantizer, computed in a
    child process with the server's CPU environment (so SGLang is never imported into the test process)."""
    d = tmp_path_factory.mktemp("fp8-oracle")
    ours = {s: quantize_block(w) for s, w in _weights().items()}
    torch.save({"weights": _weights(), "ours": ours}, d / "in.pt")
    script = textwrap.dedent(f"""
        import torch
        from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant, per_block_cast_to_fp8
        data = torch.load({str(d / "in.pt")!r})
        out = {{"deq": {{}}, "ue8m0": {{}}}}
        for s, (q, sc) in data["ours"].items():
            out["deq"][s] = block_quant_dequant(q, sc, [128, 128], torch.float32)
        for s, w in data["weights"].items():
            out["ue8m0"][s] = per_block_cast_to_fp8(w)
        torch.save(out, {str(d / "out.pt")!r})
    """)
    subprocess.run(
        [sys.executable, "-c", script], env=server_env("cpu"), check=True, timeout=300, capture_output=True
    )
    return torch.load(d / "out.pt")


@pytest.mark.parametrize("shape", SHAPES)
def test_block_roundtrip_matches_sglang_dequant(shape: tuple[int, int], sglang_oracle: dict) -> None:
    w = _weights()[shape]
    q, s = quantize_block(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    ours = dequantize_block(q, s, (128, 128), torch.float32)
    assert torch.equal(ours, sglang_oracle["deq"][shape])  # same format, same numbers as SGLang reads it
    rel = ((ours - w.float()).norm() / w.float().norm()).item()
    assert rel < 0.04  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("shape", SHAPES)
def test_ue8m0_matches_sglang_quantizer_bitwise(shape: tuple[int, int], sglang_oracle: dict) -> None:
    q, s = quantize_block(_weights()[shape], ue8m0=True)
    q_ref, s_ref = sglang_oracle["ue8m0"][shape]
    assert torch.equal(s, s_ref.float())
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.all(torch.log2(s) == torch.round(torch.log2(s)))  # powers of two


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    scale=st.floats(1e-4, 1e2),
    seed=st.integers(0, 2**16),
    bn=st.sampled_from([32, 128]),
    ue8m0=st.booleans(),
)
def test_block_error_bound(n: int, k: int, scale: float, seed: int, bn: int, ue8m0: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * scale
    q, s = quantize_block(w, (bn, bn), ue8m0=ue8m0)
    assert q.float().abs().max() <= FP8_MAX
    deq = dequantize_block(q, s, (bn, bn), torch.float32)
    s_full = s.repeat_interleave(bn, 0).repeat_interleave(bn, 1)[:n, :k]
    # half an e4m3 ulp: 2^-4 relative for normals, 2^-10 (x scale) absolute in the subnormal range
    bound = w.abs() * 2**-4 + s_full * 2**-10
    assert torch.all((deq - w).abs() <= bound * 1.0001)


def _edge_weights(dtype: torch.dtype) -> torch.Tensor:
    """[256, 384] with every case the e4m3 rounding has to get right, in separate 128x128 blocks."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 384, generator=g) * 0.02
    w[:128, :128] = 0.0  # all-zero block: the eps scale
    w[0, 5] = -0.0  # signed zero survives
    w[128:, :128] *= 1e-30  # tiny block (fp32 subnormal / underflow in bf16)
    # Saturation, ties and e4m3 subnormals: in a block whose amax is 448, y = x / scale == x.
    w[:128, 128:256] = torch.randn(128, 128, generator=g)
    w[0, 128:142] = torch.tensor(
        [
            448.0,
            -448.0,
            2**-6,
            -(2**-7),
            2**-9,
            2**-10,
            3 * 2**-10,
            2**-11,
            1.0625,
            1.1875,
            17.0,
            19.0,
            1e-8,
            -1e-8,
        ]
    )
    w[128, 128:130] = torch.tensor([3e38, -3e38]) if dtype == torch.float32 else torch.tensor([6e4, -6e4])
    w[5, 300] = float("nan")  # NaN block: NaN everywhere in it, as the reference
    if dtype != torch.float16:
        w[130, 300] = float("inf")
    return w.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that any NaN matches any NaN (the payload is not part of the format)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a32, b32 = a.float(), b.float()
    nan = a32.isnan()
    if not torch.equal(nan, b32.isnan()):
        return False
    ib = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(ib)[~nan], b.view(ib)[~nan])


KERNELS = {"native": Fp8Kernel(), "native-scalar": Fp8Kernel(table=False), "torch": Fp8Kernel(native=False)}


@pytest.fixture(params=list(KERNELS))
def kernel(request: pytest.FixtureRequest) -> Fp8Kernel:
    """The block quantizer a test passes to every call: the C kernel (``_fp8_block.c``: its bf16 table
    path where the CPU has one, and its scalar code) and the PyTorch fast path."""
    if request.param != "torch" and not native_available():
        pytest.skip("the C block quantizer did not build here (no C compiler?)")
    return KERNELS[request.param]


@pytest.fixture(params=[True, False], ids=["table", "scalar"])
def native_kernel(request: pytest.FixtureRequest) -> Fp8Kernel:
    """The C kernel with the bf16 table path allowed and with the scalar code only."""
    if not native_available():
        pytest.skip("the C block quantizer did not build here")
    return Fp8Kernel(table=request.param)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("block", [(128, 128), (32, 64)])
def test_fast_path_bit_identical_to_reference(
    dtype: torch.dtype, ue8m0: bool, block: tuple[int, int], kernel: Fp8Kernel
) -> None:
    """The in-place e4m3 rounding (fake) and the workspace quantizer (real), in C and in PyTorch,
    equal the generic-cast reference bit for bit: random weights at several magnitudes, zeros, -0,
    subnormals, ±448 and beyond-e4m3 values, e4m3 rounding ties, inf and NaN (NaN policy: a NaN
    poisons its block). fp16 always takes the PyTorch path (the C kernel reads bf16 / fp32)."""
    g = torch.Generator().manual_seed(2)
    cases = [_edge_weights(dtype)] + [
        (torch.randn(256, 512, generator=g) * s).to(dtype) for s in (1e-3, 0.02, 1.0, 300.0)
    ]
    ws = Fp8Workspace()  # shared across tensors, as in the packer: stale contents must not leak
    for w in cases:
        ref = _fake_quantize_block_reference(w, block, ue8m0=ue8m0)
        out = torch.full_like(w, 7.0)
        fake_quantize_block_into(w, out, block, ue8m0=ue8m0, workspace=ws, kernel=kernel)
        assert _same(out, ref)
        assert _same(fake_quantize_block(w, block, ue8m0=ue8m0, kernel=kernel), ref)
        q_ref, s_ref = _quantize_block_reference(w, block, ue8m0=ue8m0)
        q = torch.empty(w.shape, dtype=FP8_DTYPE)
        s = torch.empty(s_ref.shape)
        quantize_block_into(w, q, s, block, ue8m0=ue8m0, workspace=ws, kernel=kernel)
        assert _same(q, q_ref) and _same(s, s_ref)
    nan_block = fake_quantize_block(cases[0], (128, 128), kernel=kernel)[:128, 256:384]
    assert nan_block.isnan().all()  # the NaN policy, stated: the whole block, like the reference


def _all_bf16_patterns() -> torch.Tensor:
    """Every bf16 bit pattern once, [512, 128] (NaN and inf included), in random order."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return (
        bits[torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(3))]
        .view(torch.bfloat16)
        .view(512, 128)
    )


def _e4m3_grid_block() -> torch.Tensor:
    """[384, 128] whose every 32x64 (so every 128x128) block has amax 448, so y = x / scale == x:
    every bf16 value in [-448, 448], i.e. every e4m3 code, every tie between two codes and every
    value around them."""
    v = torch.arange(0, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v = v[v.float() <= 448]
    vals = torch.cat([v, -v])
    w = torch.zeros(384, 128, dtype=torch.bfloat16)
    corner = torch.zeros(384, 128, dtype=torch.bool)
    corner.view(12, 32, 2, 64)[:, 0, :, 0] = True
    w[corner] = 448.0
    free = (~corner).flatten().nonzero().squeeze(1)
    assert free.numel() >= vals.numel()
    w.view(-1)[free[: vals.numel()]] = vals
    return w


def _every_mantissa_under_odd_scales() -> torch.Tensor:
    """[128, 128 * 24] bf16 with a random, non-power-of-two amax per 128x128 block (so the scale is
    an arbitrary fp32, and x / scale is never exact), and in each block every bf16 mantissa at every
    exponent from 2^-20 below amax's up to amax's, with both signs: the table path's exponent shift
    and its switch to the scalar code at e4m3's subnormal edge, across the whole mantissa table."""
    g = torch.Generator().manual_seed(6)
    blocks = []
    for _ in range(24):
        amax = float(torch.empty(1).uniform_(1.0, 2.0, generator=g)) * 2.0 ** int(
            torch.randint(-40, 40, (1,), generator=g)
        )
        top = int(torch.tensor(amax, dtype=torch.bfloat16).view(torch.int16)) >> 7
        exps = torch.arange(top - 20, top + 1, dtype=torch.int32)
        bits = (exps[:, None] << 7 | torch.arange(128, dtype=torch.int32)[None, :]).flatten()
        vals = bits.to(torch.int16).view(torch.bfloat16)
        vals = vals[vals.float() <= torch.tensor(amax, dtype=torch.bfloat16).float()]
        vals = torch.cat([vals, -vals])
        b = torch.zeros(128 * 128, dtype=torch.bfloat16)
        b[torch.randperm(b.numel(), generator=g)[: vals.numel()]] = vals
        b[0] = amax
        blocks.append(b.view(128, 128))
    return torch.cat(blocks, dim=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_native_kernel_bit_identical_on_every_pattern(
    dtype: torch.dtype, ue8m0: bool, native_kernel: Fp8Kernel
) -> None:
    """The C kernel against the generic-cast reference on inputs the fast-path test does not reach:
    every bf16 bit pattern, every e4m3 value and tie, random fp32 bit patterns, ragged shapes (the
    kernel handles partial edge blocks itself), a strided row view, an all -0 block, a 1-column
    weight."""
    g = torch.Generator().manual_seed(4)
    cases = [
        _all_bf16_patterns().to(dtype),
        _e4m3_grid_block().to(dtype),
        _every_mantissa_under_odd_scales().to(dtype),
    ]
    if dtype == torch.float32:
        cases.append(torch.randint(-(2**31), 2**31 - 1, (256, 256), generator=g).to(torch.int32).view(dtype))
    cases += [
        (torch.randn(300, 200, generator=g) * 0.1).to(dtype),
        (torch.randn(129, 1, generator=g)).to(dtype),
        -torch.zeros(128, 128, dtype=dtype),
        (torch.randn(256, 640, generator=g) * 0.02).to(dtype)[:, 64:448],  # row stride 640
    ]
    for block in [(128, 128), (32, 64)]:
        for w in cases:
            ref = _fake_quantize_block_reference(w, block, ue8m0=ue8m0)
            assert _same(fake_quantize_block(w, block, ue8m0=ue8m0, kernel=native_kernel), ref)
            out = torch.full(w.shape, 7.0, dtype=dtype)
            assert _same(fake_quantize_block_into(w, out, block, ue8m0=ue8m0, kernel=native_kernel), ref)
            if w.is_contiguous():  # in place: the table path's slow lanes must read the input
                x = w.clone()
                assert _same(fake_quantize_block_into(x, x, block, ue8m0=ue8m0, kernel=native_kernel), ref)
            q_ref, s_ref = _quantize_block_reference(w, block, ue8m0=ue8m0)
            q, s = quantize_block(w, block, ue8m0=ue8m0, kernel=native_kernel)
            assert _same(q, q_ref) and _same(s, s_ref)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_native_kernel_large_outputs_aligned_or_not(ue8m0: bool, native_kernel: Fp8Kernel) -> None:
    """Outputs of 1 MiB and more, like a send bucket's, take streaming stores where every 64-byte
    store is aligned and ordinary ones where not: both, and in place, equal the reference, slow
    lanes (subnormal edge, inf, NaN) included."""
    w = torch.cat([_every_mantissa_under_odd_scales()] * 3)  # [384, 3072] bf16, 2.25 MiB
    w[5, 7], w[200, 1000], w[300, 2000] = float("inf"), float("-inf"), float("nan")
    buf = torch.empty(w.numel() * 2 + 64, dtype=torch.uint8)
    for block in [(128, 128), (32, 64)]:
        ref = _fake_quantize_block_reference(w, block, ue8m0=ue8m0)
        for off in (0, 2):  # buf is 64-byte aligned (torch's CPU allocator): a 2-byte offset is not
            out = buf[off : off + w.numel() * 2].view(torch.bfloat16).view(w.shape)
            assert _same(fake_quantize_block_into(w, out, block, ue8m0=ue8m0, kernel=native_kernel), ref)
        x = w.clone()
        assert _same(fake_quantize_block_into(x, x, block, ue8m0=ue8m0, kernel=native_kernel), ref)


@pytest.mark.parametrize("rounding", ["nearest", "toward_zero"])
@pytest.mark.parametrize("mantissa_bits", [3, 2, 1, 0])
def test_native_kernel_stress_grids_match_pytorch(
    rounding: str, mantissa_bits: int, native_kernel: Fp8Kernel
) -> None:
    """fake_quantize_stress (block) in C equals its PyTorch spelling: every bf16 pattern (NaN, whose
    code 0x7F becomes a finite value once low bits are cleared, included), every e4m3 value, ragged
    shapes, fp32, UE8M0, every bf16 mantissa under arbitrary block scales."""
    g = torch.Generator().manual_seed(5)
    cases = [_all_bf16_patterns(), _e4m3_grid_block(), (torch.randn(300, 200, generator=g) * 0.02)]
    cases += [cases[-1].to(torch.bfloat16), _every_mantissa_under_odd_scales()]
    for ue8m0 in (False, True):
        for block in [(128, 128), (32, 64)]:
            scheme = Fp8Scheme("block", block, ue8m0)
            for w in cases:
                ref = fake_quantize_stress(w, scheme, rounding, mantissa_bits, kernel=KERNELS["torch"])  # type: ignore[arg-type]
                got = fake_quantize_stress(w, scheme, rounding, mantissa_bits, kernel=native_kernel)  # type: ignore[arg-type]
                assert _same(got, ref)


def test_table_path_is_taken_where_the_cpu_has_it() -> None:
    """The table path is not silently off: on an AVX-512BW CPU the default kernel reports it, and a
    kernel chosen without it does not take it (the tests above then compare both against the same
    reference)."""
    if not native_available():
        pytest.skip("the C block quantizer did not build here")
    cpu_has = torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert Fp8Kernel().table_path() == cpu_has
    assert not Fp8Kernel(table=False).table_path()


def test_native_kernel_needs_its_own_flags(tmp_path: Path) -> None:
    """The kernel is built with IEEE evaluation order (fp8.native.FP8_CFLAGS), not the relaxed defaults
    of ckernels/__init__.py: the two builds are different cache entries."""
    src = fp8_native._NATIVE_SOURCE
    relaxed = native.build(src, tmp_path)
    exact = native.build(src, tmp_path, cflags=fp8_native.FP8_CFLAGS)
    assert relaxed != exact and exact.exists()
    assert not {"-ffast-math", "-fassociative-math", "-ffinite-math-only"} & set(fp8_native.FP8_CFLAGS)


def test_fast_path_falls_back_on_ragged_blocks(kernel: Fp8Kernel) -> None:
    w = (torch.randn(300, 200) * 0.1).to(torch.bfloat16)  # not whole 128x128 blocks: reference path
    assert _same(fake_quantize_block(w, kernel=kernel), _fake_quantize_block_reference(w))
    q, s = quantize_block(w, kernel=kernel)
    q_ref, s_ref = _quantize_block_reference(w)
    assert _same(q, q_ref) and _same(s, s_ref)


def test_per_tensor_and_per_channel() -> None:
    w = _weights()[(300, 200)]
    q, s = quantize_per_tensor(w)
    assert s.shape == (1,) and q.dtype == FP8_DTYPE
    assert ((dequantize_scaled(q, s, torch.float32) - w.float()).norm() / w.float().norm()) < 0.04
    w2 = w.float() * torch.logspace(-3, 1, 300).unsqueeze(1)  # rows of very different magnitude
    qc, sc = quantize_per_channel(w2)
    qt, st_ = quantize_per_tensor(w2)
    assert sc.shape == (300, 1)
    err_c = (dequantize_scaled(qc, sc, torch.float32) - w2)[:50].norm()
    err_t = (dequantize_scaled(qt, st_, torch.float32) - w2)[:50].norm()
    assert err_c < err_t  # small rows keep their precision with their own scale


def test_scheme_from_config_and_selection() -> None:
    block = scheme_from_config(
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "ignored_layers": ["model.layers.1.mlp.down_proj"],
        }
    )
    assert block == Fp8Scheme("block", (128, 128), False, ("model.layers.1.mlp.down_proj",))
    assert block.scale_suffix == "weight_scale_inv"
    assert scheme_from_config(
        {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [64, 64]}
    ).ue8m0
    assert scheme_from_config({"quant_method": "fp8"}).granularity == "per_tensor"
    ct = {
        "quant_method": "compressed-tensors",
        "ignore": ["lm_head", "re:.*layers\\.0\\..*"],
        "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}},
    }
    chan = scheme_from_config(ct)
    assert chan.granularity == "per_channel" and chan.scale_suffix == "weight_scale"
    with pytest.raises(ValueError, match="not an FP8"):
        scheme_from_config({"quant_method": "awq"})
    w = torch.zeros(64, 64)
    assert should_quantize("model.layers.0.self_attn.q_proj.weight", w, block)
    assert should_quantize("model.layers.0.mlp.experts.3.gate_proj.weight", w, block)
    assert not should_quantize("model.layers.1.mlp.down_proj.weight", w, block)  # ignored
    assert not should_quantize("model.layers.0.mlp.gate.weight", w, block)  # MoE router stays bf16
    assert not should_quantize("model.embed_tokens.weight", w, block)
    assert not should_quantize("lm_head.weight", w, block)
    assert not should_quantize("model.layers.0.self_attn.q_proj.bias", torch.zeros(64), block)
    assert not should_quantize("model.layers.0.input_layernorm.weight", torch.zeros(64), block)
    assert not should_quantize("model.layers.0.self_attn.q_proj.weight", w, chan)  # re: ignore
    assert should_quantize("model.layers.1.self_attn.q_proj.weight", w, chan)


def test_quantize_named_tensors_real_and_fake() -> None:
    scheme = Fp8Scheme("block", (32, 32))
    named = [
        ("model.layers.0.mlp.up_proj.weight", _weights()[(64, 64)]),
        ("model.norm.weight", torch.ones(64, dtype=torch.bfloat16)),
    ]
    real = dict(quantize_named_tensors(iter(named), scheme, mode="real"))
    assert list(real) == [
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.up_proj.weight_scale_inv",
        "model.norm.weight",
    ]
    assert real["model.layers.0.mlp.up_proj.weight"].dtype == FP8_DTYPE
    assert real["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (2, 2)
    fake = dict(quantize_named_tensors(iter(named), scheme, mode="fake"))
    assert list(fake) == [n for n, _ in named]
    up = fake["model.layers.0.mlp.up_proj.weight"]
    assert up.dtype == torch.bfloat16 and torch.equal(up, fake_quantize(named[0][1], scheme))
    assert torch.equal(
        up,
        dequantize_block(
            real["model.layers.0.mlp.up_proj.weight"],
            real["model.layers.0.mlp.up_proj.weight_scale_inv"],
            (32, 32),
        ),
    )
    assert fake["model.norm.weight"] is named[1][1]


def _gloo_rank(rank: int, port: int, path: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 129, generator=g)  # odd sizes: alignment must come from the bucket's ordering
    q, s = quantize_block(w)
    items = [
        ("a.weight", q),
        ("b.bias", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("a.weight_scale_inv", s),
    ]
    nbytes = sum(t.numel() * t.element_size() for _, t in items)
    with gloo_group(rank, port, "fp8-test") as group:
        if rank == 0:
            b = Bucket(items, torch.empty(nbytes, dtype=torch.uint8))
            torch.save({"names": b.names, "dtypes": b.dtypes, "shapes": b.shapes}, path + ".meta")
            broadcast_async(b.flat, group).wait()
        else:
            flat = torch.zeros(nbytes, dtype=torch.uint8)
            broadcast_async(flat, group).wait()
            torch.save(flat, path)


def test_flattened_fp8_bucket_crosses_gloo(tmp_path: Path) -> None:
    """gloo cannot broadcast float8: the flattened uint8 bucket carries e4m3 + fp32 scales byte-exactly."""
    path = str(tmp_path / "recv.pt")
    mp.start_processes(_gloo_rank, args=(free_port(), path), nprocs=2, start_method="spawn", join=True)
    meta, flat = torch.load(path + ".meta"), torch.load(path)
    assert meta["dtypes"] == ["float32", "bfloat16", "float8_e4m3fn"]  # largest itemsize first: aligned
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 129, generator=g)
    q, s = quantize_block(w)
    bias = torch.randn(3, generator=g).to(torch.bfloat16)
    expected = {"a.weight": q, "b.bias": bias, "a.weight_scale_inv": s}
    off = 0
    for name, dt, shape in zip(meta["names"], meta["dtypes"], meta["shapes"], strict=True):  # SGLang's reader
        dtype = getattr(torch, dt)
        n = torch.Size(shape).numel() * dtype.itemsize
        assert off % dtype.itemsize == 0
        got = flat[off : off + n].view(dtype).reshape(shape)
        assert torch.equal(got.view(torch.uint8), expected[name].view(torch.uint8))
        off += n
