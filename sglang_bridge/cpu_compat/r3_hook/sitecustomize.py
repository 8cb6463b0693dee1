"""SGLang 0.5.23 on a CPU-only torch: a plain host allocator for the routed-experts (R3) buffer.

With ``--enable-return-routed-experts`` SGLang keeps every token's routing in a host buffer
(``state_capturer/base.py: BaseHostCache``) allocated through
``mem_cache/pool_host/common.py: ALLOC_MEMORY_FUNCS[device]``. That table has no ``"cpu"`` entry, so
the default, ``alloc_with_host_register``, pins the buffer with ``cudaHostRegister`` and a CPU torch
dies at start-up (``torch.cuda.cudart()`` asserts). This hook adds a ``"cpu"`` entry that allocates
ordinary (unpinned) memory: there is no device to transfer to, so pinning buys nothing.

Loaded as ``sitecustomize`` from this directory, which :func:`sglang_bridge.cpu_compat.server_env`
puts on the PYTHONPATH of CPU servers that return routed experts only; SGLang's spawned scheduler
processes inherit the environment and so the hook. It patches the module when it is first
imported (a meta-path finder wrapping the real loader) and changes nothing else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_TARGET = "sglang.srt.mem_cache.pool_host.common"


def _cpu_alloc(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):  # noqa: ANN001, ANN201
    # Same signature as SGLang's allocators; plain host memory (pin_memory is meaningless here).
    return allocator.allocate(dims, dtype=dtype, device=device)


def _patch(module: types.ModuleType) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _cpu_alloc


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: types.ModuleType) -> None:
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if _TARGET in sys.modules:  # pragma: no cover - only if something imported it before site ran
    _patch(sys.modules[_TARGET])
else:
    sys.meta_path.insert(0, _PatchOnImport())
