"""CPU/gloo compatibility patches for megatron-core (pinned 0.16.1, Python 3.11, torch CPU wheel).

megatron-core assumes a CUDA device everywhere: ``torch.cuda.current_device()`` as a ``device=``
argument, ``device="cuda"`` literals, the CUDA RNG tracker, CUDA streams, and a few gloo gaps in the
MoE dispatcher. The patches below make the *genuine* TP / PP (1F1B and interleaved) / EP + MoE / SP /
DDP / distributed-optimizer code paths run on a CUDA-less host with the gloo backend, so the layout
tests exercise the same Megatron code the GPU run uses.

Rules:
  * :func:`apply` is idempotent and does nothing when CUDA is available: on a GPU, behaviour is never
    changed.
  * Call it in every rank before the first model is built (``megatron_acrl.megatron.model`` does).
  * Line numbers refer to megatron-core 0.16.1 (``megatron/core/...``).

Each patch says which megatron-core site needs it; ``docs/trainer.md`` summarises them and what newer
megatron-core releases change.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import sys
import types
from typing import Any

import torch

__all__ = ["apply", "is_applied", "needed"]

_applied = False


def needed() -> bool:
    """True when the patches are required, i.e. no CUDA device is present."""
    return not torch.cuda.is_available()


def is_applied() -> bool:
    """True once :func:`apply` has patched this process."""
    return _applied


# --------------------------------------------------------------------------------------------
# P4 helper: device literals
# --------------------------------------------------------------------------------------------


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


class _CudaLiteralsToCpu(torch.overrides.TorchFunctionMode):
    """Rewrites ``device="cuda"`` / integer device literals to CPU; ``Tensor.cuda()`` is the identity.

    Why: such literals cannot be reached by replacing a module attribute, e.g.
      pipeline_parallel/schedules.py:596,983,2138  ``torch.zeros([], device="cuda")`` (token counts)
      optimizer/optimizer.py:473-485,907, optimizer/clip_grads.py:90-207, transformer/utils.py:35,
      transformer/moe/moe_utils.py:998, rerun_state_machine.py:261.
    ``Tensor.type()`` is reported as ``torch.cuda.*`` because of string checks in
      optimizer/clip_grads.py:167, optimizer/optimizer.py:690, optimizer/distrib_optimizer.py:420
    (they reject anything that is not a ``torch.cuda.FloatTensor``).
    The mode is thread-local: CPU autograd runs backward on the calling thread, so one entry per
    process (main thread) covers forward and backward. Cost: ~25% at hidden 64, ~5% at hidden 512.
    """

    def __torch_function__(self, func, types_, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch.") :]
            return name
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], torch.Tensor | torch.dtype):
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# P5 helper: streams and events
# --------------------------------------------------------------------------------------------


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _Stream:
    """CPU work is synchronous; all streams compare equal so "side stream" branches are skipped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream)

    def __hash__(self) -> int:
        return 0


def _stub_triton_only_modules() -> None:
    """P0 (megatron-core >= 0.17 only): schedules.py imports transformer/moe/paged_stash.py, whose
    kernels module (moe/ops/paged_stash.py) does an unconditional ``import triton``; CPU torch ships no
    triton. Stub that kernels-only module; a no-op on 0.16.1 and wherever triton is installed."""
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    if "megatron.core" in sys.modules:  # too late to matter on 0.17+, harmless on 0.16
        return

    def _no_kernel(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("paged-stash kernels need triton and CUDA")

    mod = types.ModuleType(name)
    mod.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]
    mod.paged_stash_copy_kernel = mod.paged_stash_pop_kernel = _no_kernel  # type: ignore[attr-defined]
    sys.modules[name] = mod


def apply() -> bool:
    """Patch torch.cuda / megatron-core for CPU + gloo (idempotent). Returns True if patches are active.

    Does nothing (and returns False) when CUDA is available.
    """
    global _applied
    if _applied:
        return True
    if not needed():
        return False
    _stub_triton_only_modules()

    # P1 torch.cuda.current_device() is used as ``device=`` at ~175 sites, first hit in a forward at
    #    utils.py:631 (GlobalMemoryBuffer.get_tensor from dot_product_attention.py:189); also
    #    tensor_parallel/mappings.py:91-181, layers.py:552, pipeline_parallel/p2p_communication.py:190-321.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

    # P2 torch.cuda.synchronize() after every PP send/recv (p2p_communication.py:242,398) and in
    #    parallel_state.py:198. CPU collectives are synchronous already.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

    # P3 RNG tracker. model_parallel_cuda_manual_seed -> CudaRNGStatesTracker.add
    #    (tensor_parallel/random.py:235) reads torch.cuda.get_rng_state, and every attention forward
    #    forks the tracker (dot_product_attention.py:217 raises "model-parallel-rng is not added" even
    #    with dropout 0). Track the CPU default generator instead: same fork semantics (TP-region dropout
    #    differs per TP rank, replicated regions stay identical).
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(
        new_state
    )
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)  # type: ignore
    # Not torch.manual_seed: it calls torch.cuda.manual_seed_all, which would recurse into this.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore

    class _DropForkWarning(logging.Filter):  # fork() logs this on every call once the CPU RNG is tracked
        def filter(self, record: logging.LogRecord) -> bool:
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger(mrandom.__name__).addFilter(_DropForkWarning())

    # P5 CUDA streams/events: MoEAlltoAllTokenDispatcher.__init__ (moe/token_dispatcher.py:445) creates
    #    torch.cuda.Stream(), :871-873 current_stream/wait_stream/event.synchronize; shared_experts.py:123.
    default_stream = _Stream()
    torch.cuda.Stream = _Stream  # type: ignore[misc,assignment]
    torch.cuda.Event = _Event  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda device=None: default_stream  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: default_stream  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]

    # P6 0.16.1 bug (also on GPU without Transformer Engine): moe/moe_utils.py:1192 references
    #    ``te_general_gemm``, imported only when transformer_engine is installed (line 34) -> NameError
    #    in every router forward. Fixed upstream by 0.19.
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # P7 the alltoall dispatcher converts split sizes to numpy only if ``tensor.is_cuda``
    #    (moe_utils.py:1093 maybe_move_tensor_to_cpu); CPU tensors stay tensors and
    #    all_to_all_single (tensor_parallel/mappings.py:444) rejects them with a TypeError.
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    def _maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        return tensor.cpu().numpy() if (torch.is_tensor(tensor) and as_numpy) else tensor

    moe_utils.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu

    # P8 sequence parallel with the local spec: transformer/torch_norm.py:32 asserts
    #    ``not config.sequence_parallel``. SP is mandatory for MoE with TP > 1 (moe_layer.py:380). Build
    #    the torch norm anyway and tag its parameters ``sequence_parallel=True`` so finalize_model_grads
    #    (distributed/finalize_model_grads.py:354) all-reduces their grads over TP, exactly as it does for
    #    the TE norms used on GPU.
    import megatron.core.transformer.torch_norm as torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def _norm_new(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        if not getattr(config, "sequence_parallel", False):
            return original_new(cls, config, hidden_size, eps, **kwargs)
        unsharded = copy.copy(config)
        unsharded.sequence_parallel = False
        module = original_new(cls, unsharded, hidden_size, eps, **kwargs)
        for param in module.parameters():
            param.sequence_parallel = True
        return module

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(_norm_new)  # type: ignore[assignment]

    # P9 gloo has no uneven all_gather / reduce_scatter (lists of different sizes). The alltoall
    #    dispatcher with expert-TP > 1 uses them (tensor_parallel/mappings.py:150 and :194 ->
    #    "ProcessGroupGloo::allgather: invalid tensor size"). Emulate: pad-to-max all_gather, and
    #    all_reduce + slice.
    import megatron.core.tensor_parallel.mappings as mappings

    gather_even, reduce_scatter_even = (
        mappings._gather_along_first_dim,
        mappings._reduce_scatter_along_first_dim,
    )

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):  # noqa: ANN001
        if output_split_sizes is None or group.size() == 1:
            return gather_even(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)], dim=0)

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):  # noqa: ANN001
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter_even(input_, group, input_split_sizes, use_global_buffer)
        full = input_.contiguous().clone()
        torch.distributed.all_reduce(full, group=group)
        sizes = [int(s) for s in input_split_sizes]
        return torch.split(full, sizes, dim=0)[group.rank()].contiguous()

    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim

    # P10 distributed-optimizer checkpoints with torch's Adam (no Apex / Transformer Engine, so
    #    ``HAVE_APEX_OR_TE`` is False: always on CPU). Two 0.16.1 gaps in optimizer/distrib_optimizer.py:
    #    (a) ``state_dict`` (:641) asserts that the per-parameter Adam state holds a 'step', so a
    #        never-stepped optimizer (a resume in a new process) cannot build the sharded state dict
    #        it loads into. Give it zero state and step 0 first: what Adam would create lazily on its
    #        first step (so a later first step is unchanged), and overwritten by any load.
    #    (b) ``load_state_dict`` puts the param groups' step into every parameter's state (:826); the
    #        fully_reshardable / fully_sharded_model_space loaders skip 'step' in what they read, but
    #        ``_set_main_param_and_optimizer_states`` (:938) copies every key of the destination
    #        -> KeyError 'step'. Copy only what the loader provides; the step is already restored.
    #    (c) that restored step is *one* tensor shared by every parameter's state (:826); torch's Adam
    #        increments each parameter's step in place, so after a load the first step counts it once
    #        per parameter and the bias corrections go wrong (a resumed run drifts: measured 0.8x of
    #        the update off). Give every parameter its own copy.
    from megatron.core.optimizer import distrib_optimizer as dopt

    if not dopt.HAVE_APEX_OR_TE:
        original_state_dict = dopt.DistributedOptimizer.state_dict
        original_set_states = dopt.DistributedOptimizer._set_main_param_and_optimizer_states

        def _state_dict(self: Any) -> Any:
            inner = self.optimizer
            if not inner.state and self.init_state_fn is not None:
                self.init_state_fn(inner, self.config)
                for group in inner.param_groups:
                    for p in group["params"]:
                        inner.state[p]["step"] = torch.tensor(0.0)
            return original_state_dict(self)

        def _set_states(self: Any, model_param: Any, tensors: dict) -> None:
            if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                return original_set_states(self, model_param, tensors)
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            step = state.pop("step", None)
            try:
                original_set_states(self, model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        original_load_state_dict = dopt.DistributedOptimizer.load_state_dict

        def _load_state_dict(self: Any, state_dict: Any) -> None:
            original_load_state_dict(self, state_dict)
            for state in self.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()

        dopt.DistributedOptimizer.state_dict = _state_dict  # type: ignore[method-assign]
        dopt.DistributedOptimizer.load_state_dict = _load_state_dict  # type: ignore[method-assign]
        dopt.DistributedOptimizer._set_main_param_and_optimizer_states = _set_states  # type: ignore[method-assign]

    # P11 activation recompute (training.activation_recompute; MoE routing replay's REPLAY_BACKWARD):
    #     tensor_parallel/random.py CheckpointFunction.backward re-runs the layer's forward inside
    #     autograd's backward, where the P4 mode is not active (torch function modes are not carried
    #     into the backward pass), so transformer/utils.py:35 builds its causal mask on "cuda".
    #     Re-enter the mode around the recompute.
    original_ckpt_backward = mrandom.CheckpointFunction.backward

    def _ckpt_backward(ctx: Any, *grads: Any) -> Any:
        with _CudaLiteralsToCpu():
            return original_ckpt_backward(ctx, *grads)

    mrandom.CheckpointFunction.backward = staticmethod(_ckpt_backward)  # type: ignore[method-assign]

    # P4 (see _CudaLiteralsToCpu): entered for the rest of the process on this thread.
    _CudaLiteralsToCpu().__enter__()

    _applied = True
    return True
