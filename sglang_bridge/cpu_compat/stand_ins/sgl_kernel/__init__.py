"""Import-only stand-in for ``sgl_kernel`` on CPU-only machines (NOT the real package).

Why it exists: SGLang imports ``sgl_kernel`` unconditionally in many modules. The PyPI wheels
(``sgl-kernel`` / ``sglang-kernel``) carry CUDA-only binaries, and the CPU ops SGLang's CPU engine can
use live in a source-built ``sgl-kernel`` that needs Intel AMX. On a CPU without it SGLang falls back to
torch-native code for the bf16 dense and MoE paths, so no op of this module is ever called there; the
import just has to succeed.

Any attribute resolves to a function that raises ``NotImplementedError`` naming the op, so a code
path that really needs a kernel fails loudly instead of computing garbage.

This directory is put on ``PYTHONPATH`` of SGLang server processes only (see
:func:`sglang_bridge.cpu_compat.server_env`); it is never importable from the trainer.
"""

from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0.0+megatron-acrl-cpu-stand-in"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel CPU stand-in: op {name!r} was called, but this machine has no sgl_kernel build; "
            "the code path needs a GPU (or a source-built CPU sgl-kernel with AMX)"
        )

    _missing.__name__ = name
    return _missing
