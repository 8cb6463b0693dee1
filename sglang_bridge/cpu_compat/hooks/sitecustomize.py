"""Import-time patches of SGLang 0.5.23 (most for CPU servers), each opted into by the bridge.

Loaded as ``sitecustomize`` from this directory, which :func:`sglang_bridge.cpu_compat.server_env` puts
on the PYTHONPATH of every server (each runs at least ``bound_stores``, a CPU one ``paused_sleep``);
the names of the patches travel in ``SGLANG_BRIDGE_CPU_HOOKS`` (comma-separated, set by
``server_env`` from the ServerSpec, never by users). SGLang's spawned scheduler processes inherit
the environment and so the hooks. Each patch is applied when its module is first imported (a
meta-path finder wrapping the real loader) and changes nothing else.

* ``r3_alloc`` (servers returning routed experts, R3): SGLang keeps every token's routing in a host
  buffer (``state_capturer/base.py: BaseHostCache``) allocated through
  ``mem_cache/pool_host/common.py: ALLOC_MEMORY_FUNCS[device]``. That table has no ``"cpu"`` entry, so
  the default, ``alloc_with_host_register``, pins the buffer with ``cudaHostRegister`` and a CPU torch
  dies at start-up (``torch.cuda.cudart()`` asserts). The patch adds a ``"cpu"`` entry that allocates
  ordinary memory: there is no device to transfer to, so pinning buys nothing.
* ``fp8_kv`` (``kv_cache_dtype=fp8_e4m3`` on CPU): SGLang's real FP8 KV cache on CPU needs the Intel
  AMX attention kernels of ``sgl_kernel``, which the CPU install does not have. The patch emulates it in
  the bf16 cache: every K and V written by ``MHATokenToKVPool.set_kv_buffer`` is rounded through
  float8 e4m3 (saturating at +-448, scale 1.0 as SGLang uses without checkpoint KV scales), so
  attention reads exactly the values an FP8 cache would hold, for the prompt and every later token.
* ``paused_sleep`` (every CPU server): while generation is paused (``/pause_generation``, e.g. for the
  whole of a weight update) SGLang's scheduler loop ingests requests and loops straight back, never
  reaching the ``--sleep-on-idle`` sleep it takes when idle, so a paused scheduler spins on one core
  (``R`` 100% of the time). Measured on 2 shared cores, a 129 MB weight update cost the server
  0.17-0.3 s more CPU than the same buckets sent unpaused, taken from the trainer's FP8 packing and
  send; with the patch the same as unpaused. The patch makes the paused branch take the idle sleep
  (a zmq poll on the request sockets: it wakes as soon as the next request arrives). Without
  ``--sleep-on-idle`` SGLang has no sleeper and the patch changes nothing.
* ``lora_cpu`` (CPU servers with ``--enable-lora``): SGLang's LoRA layers (``srt/lora/layers.py``) and
  its torch_native backend (``srt/lora/backend/torch_backend.py``) allocate host buffers with
  ``pin_memory=True`` and call ``Tensor.pin_memory()``; a CPU torch has no pinned allocator and the
  server dies at start-up (``RuntimeError: pin_memory=True requires a CUDA or other accelerator
  backend``). Pinning only speeds host-to-device copies, and there is no device: the patch drops
  ``pin_memory`` from torch's tensor factories and makes ``Tensor.pin_memory()`` return the tensor,
  only when no accelerator is available (a GPU host keeps real pinning).
* ``bound_stores`` (every server, CPU and CUDA): SGLang's TP group rendezvous
  (``init_process_group("tcp://<--host>:<port>")``) hosts a torch TCPStore, which listens on every
  interface whatever the address; the patch hosts it on ``--host``'s address only (loopback when
  ``--host`` is a wildcard: the TP ranks of one server run on its node), through
  :class:`sglang_bridge.listeners.BoundTCPStore`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable

ENV = "SGLANG_BRIDGE_CPU_HOOKS"
E4M3_MAX = 448.0


def _cpu_alloc(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):  # noqa: ANN001, ANN201
    # Same signature as SGLang's allocators; plain host memory (pin_memory is meaningless here).
    return allocator.allocate(dims, dtype=dtype, device=device)


def _patch_r3_alloc(module: types.ModuleType) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _cpu_alloc


def fake_e4m3(x):  # noqa: ANN001, ANN201
    """``x`` rounded to float8 e4m3 (nearest-even, saturating) and back, in ``x``'s dtype."""
    import torch

    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def _patch_fp8_kv(module: types.ModuleType) -> None:
    pool = module.MHATokenToKVPool
    original = pool.set_kv_buffer

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs):  # noqa: ANN001, ANN202
        return original(self, layer, loc, fake_e4m3(cache_k), fake_e4m3(cache_v), *args, **kwargs)

    pool.set_kv_buffer = set_kv_buffer


def _patch_paused_sleep(module: types.ModuleType) -> None:
    scheduler = module.Scheduler
    # Called by every event loop (normal, overlap, disaggregated) in its paused branch, once per turn.
    record = scheduler._record_scheduler_state_for_paused_engine

    def paused_turn(self) -> None:  # noqa: ANN001
        record(self)
        # zmq poll on the tokenizer/rpc sockets (<= 1 s), as when idle; no-op without --sleep-on-idle.
        self.maybe_sleep_on_idle()

    scheduler._record_scheduler_state_for_paused_engine = paused_turn


_PINNING_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "as_tensor")


def _patch_lora_cpu(module: types.ModuleType) -> None:
    import torch

    if torch.cuda.is_available() or getattr(torch, "_bridge_unpinned", False):
        return  # real pinning on an accelerator host; applied once per process

    def unpinned(factory):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            kwargs.pop("pin_memory", None)  # no pinned allocator: plain host memory is the same thing
            return factory(*args, **kwargs)

        call.__wrapped__ = factory
        return call

    for name in _PINNING_FACTORIES:
        setattr(torch, name, unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    torch._bridge_unpinned = True


def _patch_bound_stores(module: types.ModuleType) -> None:
    create = module._create_c10d_store

    def create_bound(hostname, port, rank, world_size, timeout, use_libuv=True):  # noqa: ANN001, ANN202
        if rank != 0 or module._torchelastic_use_agent_store():
            return create(hostname, port, rank, world_size, timeout, use_libuv)
        # Imported at the first rendezvous, when torch.distributed is complete (this patch runs
        # while torch.distributed itself is being imported).
        from sglang_bridge.listeners import WILDCARDS, BoundTCPStore

        host = "127.0.0.1" if hostname in WILDCARDS else hostname  # a server's TP ranks share its node
        return BoundTCPStore(host, port, world_size, True, timeout, multi_tenant=True, use_libuv=use_libuv)

    module._create_c10d_store = create_bound


PATCHES: dict[str, tuple[str, Callable[[types.ModuleType], None]]] = {
    "r3_alloc": ("sglang.srt.mem_cache.pool_host.common", _patch_r3_alloc),
    "fp8_kv": ("sglang.srt.mem_cache.memory_pool", _patch_fp8_kv),
    "paused_sleep": ("sglang.srt.managers.scheduler", _patch_paused_sleep),
    # The LoRA layers are imported before any LoRA buffer is made (the backend's pins run per batch).
    "lora_cpu": ("sglang.srt.lora.layers", _patch_lora_cpu),
    "bound_stores": ("torch.distributed.rendezvous", _patch_bound_stores),
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, targets: dict[str, Callable[[types.ModuleType], None]]):
        self.targets = targets

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        patch = self.targets.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: types.ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _install(names: list[str]) -> None:
    unknown = [n for n in names if n not in PATCHES]
    if unknown:
        raise RuntimeError(f"{ENV} names unknown patches {unknown}; known: {sorted(PATCHES)}")
    pending = {}
    for n in names:
        target, patch = PATCHES[n]
        if target in sys.modules:  # pragma: no cover - only if something imported it before site ran
            patch(sys.modules[target])
        else:
            pending[target] = patch
    if pending:
        sys.meta_path.insert(0, _PatchOnImport(pending))


_install([n for n in os.environ.get(ENV, "").split(",") if n])
