"""What SGLang 0.5.23 needs to serve on a CPU-only machine, kept in this one place.

Applied only to the environment of the SGLang *server* child processes (never to the trainer):

1. ``SGLANG_USE_CPU_ENGINE=1``: SGLang's ``is_cpu()`` is only true with it; without it the CPU code
   paths (torch-native attention, CPU memory pools) are not selected and start-up fails.
2. An import-only ``sgl_kernel`` stand-in (``stand_ins/sgl_kernel``) first on ``PYTHONPATH``: the PyPI
   kernel wheels are CUDA-only and SGLang imports the module unconditionally. On this CPU the bf16
   dense/MoE paths never call an op of it (they fall back to torch-native code).
3. ``HF_HUB_OFFLINE=1``: models are local directories; a hub lookup would hang without internet.

Done once at install time by ``scripts/post_install.py`` (not here): the torchvision
``_meta_registrations.py`` guard, without which ``import torchvision`` (and so SGLang) fails on the
CPU torch.

4. Only for servers that need one, import-time patches (``hooks/sitecustomize.py`` on ``PYTHONPATH``,
   selected by name in ``SGLANG_BRIDGE_CPU_HOOKS``): ``r3_alloc`` for servers that return routed experts
   (R3, ``--enable-return-routed-experts``) gives SGLang's routed-experts host buffer a plain CPU
   allocator (SGLang would pin it with ``cudaHostRegister`` and die at start-up); ``fp8_kv`` emulates
   an FP8 (e4m3) KV cache, which SGLang's CPU engine only offers with Intel AMX kernels. Every CPU
   server also gets ``paused_sleep``: with ``--sleep-on-idle`` a *paused* scheduler (a weight update)
   sleeps on its sockets like an idle one instead of spinning on a core. Servers with LoRA adapters
   get ``lora_cpu``: SGLang's LoRA layers and its torch_native LoRA backend pin host memory
   (``pin_memory=True``, ``Tensor.pin_memory()``), which a CPU torch refuses at start-up.
5. Every server, CPU or CUDA, gets the hook ``bound_stores``: the TCP store of SGLang's own TP group
   listens on the server's bind address only (loopback for a loopback or wildcard ``--host``), not on
   every interface.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

STAND_IN_DIR: Path = Path(__file__).resolve().parent / "stand_ins"
"""Directory holding the ``sgl_kernel`` stand-in package; prepended to the server's PYTHONPATH."""

CPU_HOOK_DIR: Path = Path(__file__).resolve().parent / "hooks"
"""Directory holding the import-time patches (``sitecustomize.py``); on the PYTHONPATH of CPU servers
that ask for one (routed experts, emulated FP8 KV cache) only."""

R3_HOOK_DIR: Path = CPU_HOOK_DIR
"""The same directory, by the name the routed-experts code knows it."""

HOOKS_ENV = "SGLANG_BRIDGE_CPU_HOOKS"
"""Names of the patches a CPU server applies (comma-separated); set by :func:`server_env` only."""

CPU_SERVER_ENV: dict[str, str] = {"SGLANG_USE_CPU_ENGINE": "1"}
"""Variables SGLang itself requires to run its CPU engine."""


LAUNCHER_VARS = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
"""torch.distributed launcher variables that must not leak into a server's environment."""


def server_env(
    device: str,
    base: Mapping[str, str] | None = None,
    *,
    routed_experts: bool = False,
    fp8_kv_cache: bool = False,
    lora: bool = False,
) -> dict[str, str]:
    """Environment for an SGLang server child process on ``device`` ("cpu" or "cuda").

    Starts from ``base`` (default: this process's environment). For ``cpu`` it adds the variables
    above and the stand-in directory, and the patches asked for: ``routed_experts`` (the R3 allocator
    fix), ``fp8_kv_cache`` (the emulated FP8 KV cache) and ``lora`` (LoRA without pinned memory), plus
    ``paused_sleep`` always. For ``cuda``
    it leaves SGLang's real kernels alone (there the FP8 KV cache is SGLang's own,
    ``--kv-cache-dtype fp8_e4m3``). Both get ``bound_stores``.
    """
    env = dict(os.environ if base is None else base)
    # A server started from a torchrun/srun rank would otherwise inherit the trainer's rendezvous
    # (RANK, WORLD_SIZE, MASTER_PORT, ...) and SGLang's own init_process_group would wait forever
    # for trainer ranks that never join its group.
    for key in list(env):
        if key in LAUNCHER_VARS or key.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_")):
            del env[key]
    env["HF_HUB_OFFLINE"] = "1"
    env.pop(HOOKS_ENV, None)  # only ever what this call asks for
    path = [str(CPU_HOOK_DIR)]
    hooks = []
    if device == "cpu":
        env.update(CPU_SERVER_ENV)
        asked = (("r3_alloc", routed_experts), ("fp8_kv", fp8_kv_cache), ("lora_cpu", lora))
        hooks = [name for name, on in asked if on]
        hooks.append("paused_sleep")  # every CPU server: a no-op unless it runs with --sleep-on-idle
        path.append(str(STAND_IN_DIR))
    hooks.append("bound_stores")  # every server
    old = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(path + ([old] if old else []))
    env[HOOKS_ENV] = ",".join(hooks)
    return env


__all__ = [
    "CPU_HOOK_DIR",
    "CPU_SERVER_ENV",
    "HOOKS_ENV",
    "LAUNCHER_VARS",
    "R3_HOOK_DIR",
    "STAND_IN_DIR",
    "server_env",
]
