"""FP8 (e4m3) weight quantization for the rollout copy: pure tensor functions, no SGLang import.

Formats (what SGLang's loaders expect next to each quantized ``<module>.weight``):

* block (DeepSeek-V3 / Qwen3-FP8, ``weight_block_size: [bn, bk]``): ``weight`` e4m3 ``[N, K]`` and
  ``weight_scale_inv`` fp32 ``[ceil(N/bn), ceil(K/bk)]`` with ``W ~= q * scale_inv`` per block;
  ``scale_inv = amax(block) / 448`` or, with UE8M0 (``scale_fmt: "ue8m0"``, DeepGEMM; what SGLang's own
  ``per_block_cast_to_fp8`` does), that value rounded *up* to a power of two.
* per-tensor (``quant_method: fp8`` without ``weight_block_size``): ``weight_scale`` fp32 ``[1]``.
* per-channel (compressed-tensors ``strategy: channel``): ``weight_scale`` fp32 ``[N, 1]``.

Which tensors are quantized follows the served checkpoint's ``quantization_config``
(:func:`scheme_from_config`, :func:`should_quantize`): the 2-D projection weights of decoder layers,
minus the config's ignored layers; embeddings, ``lm_head``, norms, biases and MoE routers stay in bf16
(SGLang builds those layers without a quant method).

*Fake-quant* (:func:`fake_quantize`, ``mode="fake"`` in :func:`quantize_named_tensors`) returns
``dequantize(quantize(W))`` in the original dtype: the FP8 rounding of the weights, served by a bf16
engine. A CPU SGLang cannot serve FP8 (needs Intel AMX), so CPU runs use it to reproduce FP8 weight
error; it is *not* FP8 activation/GEMM numerics, and logs/metrics must label it "fake-quant".

Rooms: :mod:`~sglang_bridge.fp8.scheme` (the format, the scheme, its ``quantization_config``),
:mod:`~sglang_bridge.fp8.block` (block quantizers and their reference), :mod:`~sglang_bridge.fp8.native`
(the C kernel and :class:`Fp8Kernel`, the caller's choice of block quantizer),
:mod:`~sglang_bridge.fp8.fast_block` (the PyTorch fast block path), :mod:`~sglang_bridge.fp8.quantize`
(per-tensor / per-channel, any scheme, named-tensor streams), :mod:`~sglang_bridge.fp8.checkpoint`
(the FP8 checkpoint a real FP8 server serves), :mod:`~sglang_bridge.fp8.stress` (the study's
truncated-FP8 emulation).
"""

from sglang_bridge.fp8.block import (
    dequantize_block,
    fake_quantize_block,
    fake_quantize_block_into,
    quantize_block,
    quantize_block_into,
)
from sglang_bridge.fp8.checkpoint import served_fp8_checkpoint, write_fp8_checkpoint
from sglang_bridge.fp8.fast_block import Fp8Workspace
from sglang_bridge.fp8.native import DEFAULT_KERNEL, Fp8Kernel, native_available
from sglang_bridge.fp8.quantize import (
    dequantize,
    dequantize_scaled,
    fake_quantize,
    quantize,
    quantize_named_tensors,
    quantize_per_channel,
    quantize_per_tensor,
)
from sglang_bridge.fp8.scheme import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Scheme,
    Granularity,
    fp8_quantization_config,
    is_router,
    scheme_from_config,
    should_quantize,
)
from sglang_bridge.fp8.stress import Rounding, fake_quantize_named_stress, fake_quantize_stress, to_e4m3

__all__ = [
    "DEFAULT_KERNEL",
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8Kernel",
    "Fp8Scheme",
    "Fp8Workspace",
    "Granularity",
    "Rounding",
    "dequantize",
    "dequantize_block",
    "dequantize_scaled",
    "fake_quantize",
    "fake_quantize_block",
    "fake_quantize_block_into",
    "fake_quantize_named_stress",
    "fake_quantize_stress",
    "fp8_quantization_config",
    "is_router",
    "native_available",
    "quantize",
    "quantize_block",
    "quantize_block_into",
    "quantize_named_tensors",
    "quantize_per_channel",
    "quantize_per_tensor",
    "scheme_from_config",
    "served_fp8_checkpoint",
    "should_quantize",
    "to_e4m3",
    "write_fp8_checkpoint",
]
