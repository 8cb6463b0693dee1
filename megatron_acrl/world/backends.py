"""What the run runs on, said once: the entry point's warning filter and its one-line backends report.

Megatron-Core warns, as it is imported, that Transformer Engine and Apex are absent: six
``UserWarning`` s in every rank, and six more in the checkpoint writer's helper each rank spawns
(which re-imports the entry module). On a CPU host nobody can act on them, since neither package
exists there. :func:`quiet_absent_backends` ignores exactly those messages, from ``megatron.core``
only; every other warning, Megatron's included, still shows. It is the entry point's alone
(``python -m megatron_acrl.train`` installs it before its first import of Megatron, in every rank
torchrun starts and in every child a rank spawns): importing this module changes nothing, and a
library or a test that builds a model directly still sees them.

What the warnings said, :func:`backends_line` says in one line on rank 0, from what the run
actually uses::

    backends: megatron-core 0.16.1 (local layers, torch norm, torch AdamW; no Transformer Engine,
    no Apex), gloo, SGLang 0.5.23 on cpu, FP8 fake-quant (fp8_block 32x32), router none

This module imports nothing heavy at import time (it must load before Megatron does).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import warnings
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from megatron_acrl.config import Config

ABSENT_BACKEND_MESSAGES = (
    # megatron.core.optimizer, .optimizer.optimizer, .optimizer.clip_grads, megatron_fsdp's
    # mixed_precision: "... Falling back to Torch optimizers." / "... to local implementations of ..."
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    # megatron.core.models.backends, .models.gpt.gpt_layer_specs (and the other models' specs)
    r"Apex is not installed\. Falling back to Torch Norm",
)
"""The messages :func:`quiet_absent_backends` ignores (regular expressions, matched at the start)."""

ABSENT_BACKEND_MODULE = r"megatron\.core(\.|$)"
"""Whose warnings they are: the same words from any other package still show."""


def quiet_absent_backends() -> None:
    """Ignore Megatron-Core's "Transformer Engine / Apex is not installed" warnings in this process.

    Idempotent (``warnings.filterwarnings`` replaces an equal filter rather than adding a second).
    Call it before Megatron is imported: the warnings fire at import time."""
    for message in ABSENT_BACKEND_MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=ABSENT_BACKEND_MODULE)


class ServedCopy(Protocol):
    """What the rollout servers' handle says about the copy it serves (rank 0's ``ctx.servers``)."""

    device: str
    """The servers' device: cpu or cuda."""
    fp8_mode: str
    """How an FP8 quantization reaches them: real or fake."""


_OPTIONAL = (("Transformer Engine", "transformer_engine"), ("Apex", "apex"))
"""The GPU kernel packages Megatron-Core falls back from (name, import name)."""


def _version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def megatron_backends() -> str:
    """Megatron-Core's version and the kernels it runs with here, e.g. ``megatron-core 0.16.1 (local
    layers, torch norm, torch AdamW; no Transformer Engine, no Apex)``. Imports Megatron (through
    :mod:`megatron_acrl.megatron`, the one room that imports ``megatron.core``)."""
    from megatron_acrl.megatron.model import use_transformer_engine

    absent = [name for name, mod in _OPTIONAL if importlib.util.find_spec(mod) is None]
    # The layer spec's rule (megatron.model.layer_spec): TE layers carry TE's norm; the local spec
    # with RMSNorm uses torch's norm whether Apex is there or not.
    layers = "Transformer Engine layers" if use_transformer_engine() else "local layers, torch norm"
    # megatron.core.optimizer's fallback order: TE's FusedAdam, else Apex's, else torch's AdamW.
    optim = "torch AdamW" if len(absent) == len(_OPTIONAL) else "fused Adam"
    missing = "; " + ", ".join(f"no {name}" for name in absent) if absent else ""
    return f"megatron-core {_version('megatron-core')} ({layers}, {optim}{missing})"


def rollout_backends(cfg: Config, servers: ServedCopy | None) -> str:
    """The rollout side: SGLang's version, device, the served copy's precision, the router; or the
    recording a replay reads (``servers`` None: ``--load-rollouts``, no SGLang)."""
    if servers is None:
        return "recorded rollouts (no SGLang)"
    r = cfg.rollout
    if r.quantization == "none":
        precision = "BF16 rollout"
    else:
        mode = "fake-quant" if servers.fp8_mode == "fake" else servers.fp8_mode
        block = "x".join(str(n) for n in r.fp8_block_size)
        scheme = f"{r.quantization} {block}" if r.quantization == "fp8_block" else r.quantization
        stress = ", stress emulation" if r.stress_quantization else ""
        precision = f"FP8 {mode} ({scheme}{stress})"
    router = f"router sglang-router ({r.router_policy})" if r.router == "sglang" else "router none"
    return f"SGLang {_version('sglang')} on {servers.device}, {precision}, {router}"


def backends_line(cfg: Config, servers: ServedCopy | None) -> str:
    """The one line the entry point prints on rank 0 once the run is set up (see module doc), with
    the trainer world's process-group backend (gloo / nccl) once it is initialised."""
    import torch.distributed as dist

    world = f", {dist.get_backend()}" if dist.is_available() and dist.is_initialized() else ""
    return f"backends: {megatron_backends()}{world}, {rollout_backends(cfg, servers)}"
