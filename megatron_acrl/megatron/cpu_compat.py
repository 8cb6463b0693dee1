"""CPU/gloo compatibility patches for megatron-core (pinned 0.16.1, Python 3.11, torch CPU wheel).

megatron-core assumes a CUDA device everywhere: ``torch.cuda.current_device()`` as a ``device=``
argument, ``device="cuda"`` literals, the CUDA RNG tracker, CUDA streams, and a few gloo gaps in the
MoE dispatcher. The patches below make the *genuine* TP / PP (1F1B and interleaved) / EP + MoE / SP /
DDP / distributed-optimizer code paths run on a CUDA-less host with the gloo backend, so the layout
tests exercise the same Megatron code the GPU run uses.

Rules:
  * Nothing is patched at import. The entry point that builds a model calls :func:`apply` once per
    process, before :func:`~megatron_acrl.megatron.base.initialize_parallel`:
    ``megatron_acrl.world.distributed.init_distributed`` (driver, SFT warm start, study runs), the test
    workers and ``benchmarks/logprob.py``. :func:`require` (called by ``initialize_parallel`` and
    ``model.build_model_chunks``) turns a forgotten call into a clear error instead of a CUDA error
    deep inside Megatron.
  * :func:`apply` runs the table :data:`PATCHES` in order, is idempotent and runs none of them when
    CUDA is available: on a GPU, the compute is never changed (only P12, below, runs there).
  * Line numbers refer to megatron-core 0.16.1 (``megatron/core/...``).

Import order (why :func:`apply` may run after ``megatron.core`` is imported). Every patch replaces an
attribute that megatron-core looks up when it *calls* it, never one it copies at import:
``torch.cuda.current_device`` / ``synchronize`` / ``Stream`` / ... are called as ``torch.cuda.X(...)``
(megatron-core 0.16.1 has no ``from torch.cuda import``); the replaced megatron functions
(``mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim``, ``random._get_cuda_rng_state``
/ ``_set_cuda_rng_state``, ``moe_utils.te_general_gemm``) are called through their own module's
globals; ``maybe_move_tensor_to_cpu``, the one name imported elsewhere (``token_dispatcher``), is
replaced in both modules; ``WrappedTorchNorm``, ``CheckpointFunction`` and ``DistributedOptimizer``
are patched on the class objects every importer shares. The exceptions: P0 must run before the first
``import megatron.core`` (megatron-core >= 0.17 only; a no-op on 0.16.1), and P4's function mode is
entered on the calling thread, so :func:`apply` must be called on the thread that trains (the main
thread; CPU autograd runs backward on the calling thread).

Each patch is one function below, named for what it does, with the megatron-core site that needs
it; ``docs/trainer.md`` summarises them and what newer megatron-core releases change.

One patch is not about CPUs and runs on every host, GPU included (:data:`EVERY_HOST_PATCHES`, applied
by the same :func:`apply`): P12, the helper process of megatron-core's checkpoint writer ignores the
stop signals and dies with its rank. This is the one module that patches megatron-core.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import importlib.util
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["EVERY_HOST_PATCHES", "PATCHES", "Patch", "apply", "is_applied", "needed", "require"]

_applied = False
"""Whether :func:`apply` patched this process for CPU: the record of the CPU patches' state."""
_applied_every_host = False
"""Whether :func:`apply` ran :data:`EVERY_HOST_PATCHES` in this process."""


def needed() -> bool:
    """True when the patches are required, i.e. no CUDA device is present."""
    return not torch.cuda.is_available()


def is_applied() -> bool:
    """True once :func:`apply` has patched this process."""
    return _applied


def require() -> None:
    """Raise a RuntimeError naming :func:`apply` when this CUDA-less process has not been patched."""
    if needed() and not _applied:
        raise RuntimeError(
            "megatron-core needs the CPU/gloo patches on this host without CUDA: call "
            "megatron_acrl.megatron.cpu_compat.apply() once per process before initialize_parallel() "
            "or building a model (megatron_acrl.world.distributed.init_distributed does)"
        )


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


# --------------------------------------------------------------------------------------------
# The patches, in the order apply() runs them
# --------------------------------------------------------------------------------------------


def _stub_paged_stash() -> None:
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


def _current_device_is_cpu() -> None:
    """P1 torch.cuda.current_device() is used as ``device=`` at ~175 sites, first hit in a forward at
    utils.py:631 (GlobalMemoryBuffer.get_tensor from dot_product_attention.py:189); also
    tensor_parallel/mappings.py:91-181, layers.py:552, pipeline_parallel/p2p_communication.py:190-321."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _synchronize_is_noop() -> None:
    """P2 torch.cuda.synchronize() after every PP send/recv (p2p_communication.py:242,398) and in
    parallel_state.py:198. CPU collectives are synchronous already."""
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]


class _DropForkWarning(logging.Filter):
    """The RNG tracker's fork() logs this on every call once it tracks the CPU generator (P3)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _rng_tracker_on_cpu_generator() -> None:
    """P3 RNG tracker. model_parallel_cuda_manual_seed -> CudaRNGStatesTracker.add
    (tensor_parallel/random.py:235) reads torch.cuda.get_rng_state, and every attention forward
    forks the tracker (dot_product_attention.py:217 raises "model-parallel-rng is not added" even
    with dropout 0). Track the CPU default generator instead: same fork semantics (TP-region dropout
    differs per TP rank, replicated regions stay identical)."""
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(
        new_state
    )
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)  # type: ignore
    # Not torch.manual_seed: it calls torch.cuda.manual_seed_all, which would recurse into this.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore
    logging.getLogger(mrandom.__name__).addFilter(_DropForkWarning())


def _fake_streams() -> None:
    """P5 CUDA streams/events: MoEAlltoAllTokenDispatcher.__init__ (moe/token_dispatcher.py:445)
    creates torch.cuda.Stream(), :871-873 current_stream/wait_stream/event.synchronize;
    shared_experts.py:123."""
    default_stream = _Stream()
    torch.cuda.Stream = _Stream  # type: ignore[misc,assignment]
    torch.cuda.Event = _Event  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda device=None: default_stream  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: default_stream  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]


def _define_te_general_gemm() -> None:
    """P6 0.16.1 bug (also on GPU without Transformer Engine): moe/moe_utils.py:1192 references
    ``te_general_gemm``, imported only when transformer_engine is installed (line 34) -> NameError
    in every router forward. Fixed upstream by 0.19."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    return tensor.cpu().numpy() if (torch.is_tensor(tensor) and as_numpy) else tensor


def _split_sizes_as_numpy() -> None:
    """P7 the alltoall dispatcher converts split sizes to numpy only if ``tensor.is_cuda``
    (moe_utils.py:1093 maybe_move_tensor_to_cpu); CPU tensors stay tensors and all_to_all_single
    (tensor_parallel/mappings.py:444) rejects them with a TypeError. token_dispatcher imports the
    function by name, so both modules get the replacement."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu


def _torch_norm_under_sequence_parallel() -> None:
    """P8 sequence parallel with the local spec: transformer/torch_norm.py:32 asserts
    ``not config.sequence_parallel``. SP is mandatory for MoE with TP > 1 (moe_layer.py:380). Build
    the torch norm anyway and tag its parameters ``sequence_parallel=True`` so finalize_model_grads
    (distributed/finalize_model_grads.py:354) all-reduces their grads over TP, exactly as it does for
    the TE norms used on GPU."""
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


def _uneven_gloo_collectives() -> None:
    """P9 gloo has no uneven all_gather / reduce_scatter (lists of different sizes). The alltoall
    dispatcher with expert-TP > 1 uses them (tensor_parallel/mappings.py:150 and :194 ->
    "ProcessGroupGloo::allgather: invalid tensor size"). Emulate: pad-to-max all_gather, and
    all_reduce + slice."""
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


def _distributed_optimizer_checkpoints() -> None:
    """P10 distributed-optimizer checkpoints with torch's Adam (no Apex / Transformer Engine, so
    ``HAVE_APEX_OR_TE`` is False: always on CPU). Gaps of 0.16.1 in optimizer/distrib_optimizer.py:

    (a) ``state_dict`` (:641) asserts that the per-parameter Adam state holds a 'step', so a
        never-stepped optimizer (a resume in a new process) cannot build the sharded state dict
        it loads into. Give it zero state and step 0 first: what Adam would create lazily on its
        first step (so a later first step is unchanged), and overwritten by any load.
    (b) ``load_state_dict`` puts the param groups' step into every parameter's state (:826); the
        fully_reshardable / fully_sharded_model_space loaders skip 'step' in what they read, but
        ``_set_main_param_and_optimizer_states`` (:938) copies every key of the destination
        -> KeyError 'step'. Copy only what the loader provides; the step is already restored.
    (c) that restored step is *one* tensor shared by every parameter's state (:826); torch's Adam
        increments each parameter's step in place, so after a load the first step counts it once
        per parameter and the bias corrections go wrong (a resumed run drifts: measured 0.8x of
        the update off). Give every parameter its own copy.
    """
    from megatron.core.optimizer import distrib_optimizer as dopt

    if dopt.HAVE_APEX_OR_TE:
        return
    cls = dopt.DistributedOptimizer
    original_state_dict, original_load_state_dict = cls.state_dict, cls.load_state_dict
    original_set_states = cls._set_main_param_and_optimizer_states

    def _state_dict(self: Any) -> Any:  # (a)
        inner = self.optimizer
        if not inner.state and self.init_state_fn is not None:
            self.init_state_fn(inner, self.config)
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p]["step"] = torch.tensor(0.0)
        return original_state_dict(self)

    def _set_states(self: Any, model_param: Any, tensors: dict) -> None:  # (b)
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

    def _load_state_dict(self: Any, state_dict: Any) -> None:  # (c)
        original_load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    cls.state_dict = _state_dict  # type: ignore[method-assign]
    cls.load_state_dict = _load_state_dict  # type: ignore[method-assign]
    cls._set_main_param_and_optimizer_states = _set_states  # type: ignore[method-assign]


def _device_literals_in_recompute() -> None:
    """P11 activation recompute (training.activation_recompute; MoE routing replay's REPLAY_BACKWARD):
    tensor_parallel/random.py CheckpointFunction.backward re-runs the layer's forward inside
    autograd's backward, where the P4 mode is not active (torch function modes are not carried into
    the backward pass), so transformer/utils.py:35 builds its causal mask on "cuda". Re-enter the
    mode around the recompute."""
    import megatron.core.tensor_parallel.random as mrandom

    original_ckpt_backward = mrandom.CheckpointFunction.backward

    def _ckpt_backward(ctx: Any, *grads: Any) -> Any:
        with _CudaLiteralsToCpu():
            return original_ckpt_backward(ctx, *grads)

    mrandom.CheckpointFunction.backward = staticmethod(_ckpt_backward)  # type: ignore[method-assign]


def _device_literals_to_cpu() -> None:
    """P4 (see :class:`_CudaLiteralsToCpu`): entered for the rest of the process on this thread."""
    _CudaLiteralsToCpu().__enter__()


# --------------------------------------------------------------------------------------------
# P12, on every host: the checkpoint writer's helper process
# --------------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _checkpoint_helper_init(parent_pid: int, die_with_parent: bool) -> None:
    """First thing the checkpoint writer's helper (a spawned ``SyncManager`` server) runs.

    Stop signals are the rank's to act on (:mod:`megatron_acrl.world.signals`): torchrun's agent and SLURM
    signal the rank's whole process group, and a helper ended by that SIGTERM (the manager ignores
    only SIGINT) takes the rank's checkpoint-on-SIGTERM down with BrokenPipe. Ignored signals stay
    ignored; the helper still ends with the rank: ``multiprocessing``'s finaliser shuts it down at a
    normal exit, and ``PR_SET_PDEATHSIG`` kills it when the rank dies any other way (SIGKILL, the
    OOM killer), so no orphan holds the rank's memory or files.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not die_with_parent:
        return
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the finaliser still shuts it down
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the rank died before PDEATHSIG was armed
        os._exit(0)


def _checkpoint_helper_survives_stop_signals() -> None:
    """P12 (every host) dist_checkpointing/strategies/filesystem_async.py:51
    ``_get_write_results_queue`` starts a ``spawn`` ``SyncManager`` per rank at its first save and
    keeps it for the process: the result queue of every later save goes through it. Start it with
    :func:`_checkpoint_helper_init` (stop signals ignored, dies with the rank). ``PR_SET_PDEATHSIG``
    fires when the *thread* that started the helper exits, so it is armed only when that thread is
    the main thread (the trainer's saves are; a helper started elsewhere ends with the finaliser)."""
    from multiprocessing.managers import SyncManager

    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs_async

    def _get_write_results_queue() -> Any:
        if fs_async._results_queue is None:
            manager = SyncManager(ctx=mp.get_context("spawn"))
            main = threading.current_thread() is threading.main_thread()
            manager.start(_checkpoint_helper_init, (os.getpid(), main))
            fs_async._results_queue = manager.Queue()  # the proxy keeps the manager alive, as before
        return fs_async._results_queue

    fs_async._get_write_results_queue = _get_write_results_queue


# --------------------------------------------------------------------------------------------
# The tables and their runner
# --------------------------------------------------------------------------------------------


class Patch(NamedTuple):
    """One named patch: its number in ``docs/trainer.md`` and the function that applies it."""

    id: str
    apply: Callable[[], None]


PATCHES: tuple[Patch, ...] = (
    Patch("P0", _stub_paged_stash),
    Patch("P1", _current_device_is_cpu),
    Patch("P2", _synchronize_is_noop),
    Patch("P3", _rng_tracker_on_cpu_generator),
    Patch("P5", _fake_streams),
    Patch("P6", _define_te_general_gemm),
    Patch("P7", _split_sizes_as_numpy),
    Patch("P8", _torch_norm_under_sequence_parallel),
    Patch("P9", _uneven_gloo_collectives),
    Patch("P10", _distributed_optimizer_checkpoints),
    Patch("P11", _device_literals_in_recompute),
    Patch("P4", _device_literals_to_cpu),  # last: the mode stays entered on this thread
)
"""Every CPU patch, in the order :func:`apply` runs them."""

EVERY_HOST_PATCHES: tuple[Patch, ...] = (Patch("P12", _checkpoint_helper_survives_stop_signals),)
"""The patches :func:`apply` runs on every host, with CUDA too (before the CPU ones)."""


def apply() -> bool:
    """Patch torch.cuda / megatron-core for CPU + gloo (idempotent). Returns True if patches are active.

    The CPU patches do nothing (and it returns False) when CUDA is available; the
    :data:`EVERY_HOST_PATCHES` run either way. Call it once per process, on the thread that trains,
    before ``initialize_parallel`` (see the module docstring).
    """
    global _applied, _applied_every_host
    if not _applied_every_host:
        for patch in EVERY_HOST_PATCHES:
            patch.apply()
        _applied_every_host = True
    if _applied:
        return True
    if not needed():
        return False
    for patch in PATCHES:
        patch.apply()
    _applied = True
    return True
