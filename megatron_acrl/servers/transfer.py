"""What the rollout servers hold and how a trainer rank sends it: the FP8 scheme and mode of the
served copy, the trainer's HF tensors cast (and stress-quantized) as the servers take them, where the
servers dial a rank's weight-sync stores, a non-zero rank's weight source, and what a failed sync
calls for.

Rank 0's :class:`megatron_acrl.servers.handle.RolloutServers` owns the servers and the update's
lifecycle; every other source rank uses only this module (``rollout.weight_sync: per_source``).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

import torch

from megatron_acrl.config import Config, ConfigError
from sglang_bridge.client import ServerGoneError
from sglang_bridge.fp8 import Fp8Scheme, fake_quantize_named_stress
from sglang_bridge.listeners import address_towards
from sglang_bridge.server import ServerSpec
from sglang_bridge.weight_sync import (
    ControlStore,
    ManifestMismatchError,
    StreamMismatchError,
    WeightSource,
    WeightSyncError,
)

SERVED_DTYPE = getattr(torch, ServerSpec.dtype)
"""What the servers compute in (``--dtype``): floating weights are cast to it before they are sent."""
Meta = list[tuple[str, tuple[int, ...], torch.dtype]]

GRANULARITY = {"fp8_block": "block", "fp8_per_tensor": "per_tensor", "fp8_per_channel": "per_channel"}


def fp8_scheme(cfg: Config) -> Fp8Scheme | None:
    """The rollout quantization of ``cfg`` (None for BF16 rollout)."""
    q = cfg.rollout.quantization
    if q == "none":
        return None
    return Fp8Scheme(
        granularity=GRANULARITY[q],
        block_size=tuple(cfg.rollout.fp8_block_size),  # type: ignore[arg-type]
        ue8m0=cfg.rollout.fp8_scale_ue8m0,
    )


def resolve_device(cfg: Config) -> str:
    if cfg.rollout.device != "auto":
        return cfg.rollout.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_fp8_mode(cfg: Config, device: str) -> str:
    """``rollout.fp8_mode`` on ``device``: auto is real FP8 on cuda servers and fake-quant on CPU
    servers; fake also works on cuda (FP8-rounded bf16 on a bf16 server, e.g. to compare with a CPU
    run); real on a CPU server is refused, since SGLang serves FP8 there only with Intel AMX kernels."""
    mode = cfg.rollout.fp8_mode
    if mode == "auto":
        return "real" if device == "cuda" else "fake"
    if mode == "real" and device != "cuda" and cfg.rollout.quantization != "none":
        raise ConfigError(
            [
                (
                    "rollout.fp8_mode",
                    f"real FP8 needs a cuda server, but the rollout device is {device}; use fp8_mode "
                    "auto or fake (FP8-rounded bf16), or rollout.device=cuda",
                )
            ]
        )
    return mode


def check_fp8_mode(cfg: Config, fp8_mode: str) -> None:
    """Refuse, before any server starts, what servers holding real FP8 weights cannot do: serve the
    stress emulations (fake-quant only), or evaluate the trainer's unquantized weights."""
    if fp8_scheme(cfg) is None or fp8_mode != "real":
        return
    if cfg.rollout.stress_quantization:
        raise ConfigError(
            [
                (
                    "rollout.fp8_mode",
                    "fp8_rounding / fp8_mantissa_bits / fp8_quantize_router are fake-quant emulations "
                    "and a cuda server gets real FP8 under fp8_mode auto; set rollout.fp8_mode=fake",
                )
            ]
        )
    if cfg.training.eval_trainer_weights:
        raise ConfigError(
            [
                (
                    "training.eval_trainer_weights",
                    "evaluates the trainer's unquantized weights on the rollout servers, which hold "
                    "real FP8 weights here; set rollout.fp8_mode=fake or turn it off",
                )
            ]
        )


def sync_address(cfg: Config, single_node: bool) -> str:
    """Where the servers reach this rank's weight-sync stores (which listen there only):
    ``rollout.weight_sync_address``, else loopback when the whole job (trainer and servers) runs on
    one node, else this node's interface towards the first server, else this host's name."""
    r = cfg.rollout
    if r.weight_sync_address:
        return r.weight_sync_address
    if single_node and not r.server_urls:
        return "127.0.0.1"
    return address_towards(r.server_urls[0]) if r.server_urls else socket.getfqdn()


def weights_for_servers(
    cfg: Config, stream: Iterable[tuple[str, torch.Tensor]], *, quantize: bool
) -> Iterable[tuple[str, torch.Tensor]]:
    """The trainer's HF tensors as the servers take them, on whichever rank sends them: cast to the
    servers' dtype (the trainer may hold fp32 masters; explicit, per tensor: names and shapes are
    still validated by the bridge), and the stress emulations applied (``quantize``)."""

    def cast(items: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, t in items:
            out = t.to(SERVED_DTYPE) if t.is_floating_point() and t.dtype != SERVED_DTYPE else t
            # Unbound before and after the yield: a name bound here would keep this tensor alive
            # while the stream gathers the next one (one full tensor more than the sync's bound).
            del t
            yield name, out
            del out

    out = cast(stream)
    scheme = fp8_scheme(cfg)
    if scheme is not None and cfg.rollout.stress_quantization and quantize:
        r = cfg.rollout
        out = fake_quantize_named_stress(
            out,
            scheme,
            r.fp8_rounding,
            r.fp8_mantissa_bits,
            quantize_router=r.fp8_quantize_router,
            also=lm_head_names(cfg) if r.fp8_quantize_lm_head else (),
        )
    return out


def lm_head_names(cfg: Config) -> tuple[str, ...]:
    """The output projection's served HF name: ``lm_head.weight``, or with tied embeddings (no such
    tensor: ``model.tie_embeddings``, as the converter maps it) the embedding table it shares."""
    return ("model.embed_tokens.weight",) if cfg.model.tie_embeddings else ("lm_head.weight",)


def meta_for_servers(meta: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> Meta:
    """:func:`weights_for_servers`'s output metadata for a stream of ``meta``."""
    return [
        (n, tuple(s), SERVED_DTYPE if d.is_floating_point and d != SERVED_DTYPE else d) for n, s, d in meta
    ]


def open_weight_source(
    cfg: Config, control_address: tuple[str, int], index: int, label: str, address: str
) -> WeightSource:
    """A non-zero rank's weight-sync source (``index`` of ``cfg.weight_sync_sources``), on rank 0's
    control store; it joins the update group at its first sync."""
    r = cfg.rollout
    control = ControlStore.join(*control_address, timeout_s=r.sync_timeout_s)
    port = r.weight_sync_port + 1 + index if r.weight_sync_port else None
    device = "cuda" if resolve_device(cfg) == "cuda" else "cpu"
    return WeightSource(control, index, label=label, address=address, port=port, device=device)


def push_from_source(
    cfg: Config,
    source: WeightSource,
    stream: Iterable[tuple[str, torch.Tensor]],
    meta: Meta,
    *,
    quantize: bool,
) -> dict[str, float]:
    """This rank's part of rank 0's update: its own weights, to every server."""
    report = source.sync(weights_for_servers(cfg, stream, quantize=quantize), meta_for_servers(meta))
    return {"sync/source_bytes": float(report.num_bytes)}


RESTART = "restart the servers"
HUNG = "replace the hung servers"
RECONNECT = "reconnect the synchronizer"


def recovery(error: BaseException, servers_dead: bool) -> str | None:
    """What a weight sync that failed on rank 0 with ``error`` calls for: :data:`RESTART` (a server
    died: ``servers_dead``), :data:`HUNG` (a server did not answer in time: kill and replace the
    hung ones, :mod:`megatron_acrl.servers.recovery`), :data:`RECONNECT` (a failed source or a broken
    group: new update groups), or None (bad input: a retry would fail the same way)."""
    if isinstance(error, ServerGoneError) or servers_dead:
        return RESTART
    if isinstance(error, TimeoutError):  # WeightSyncTimeoutError, or a control call's own timeout
        return HUNG
    if isinstance(error, WeightSyncError) and not isinstance(
        error, ManifestMismatchError | StreamMismatchError
    ):
        return RECONNECT
    return None
