"""The driver's handle on its rollout servers (rank 0 only): SGLang processes, generation fan-out,
weight updates, restarts.

On a single node :class:`RolloutServers` starts ``rollout.num_servers`` local SGLang servers from
the served model directory; multi-node launch scripts start servers on their own nodes and pass
``rollout.server_urls``. Weights go through the bridge's
:class:`sglang_bridge.weight_sync.DistributedWeightSynchronizer`: FP8 is real (e4m3 + scales) on GPU
servers and *fake-quant* (FP8 rounding served in bf16) on CPU servers, which cannot run FP8 kernels;
the mode is reported in every update's ``sync/*`` metrics. The stress emulations (truncated or
coarser e4m3, quantized routers) are applied here, before the synchronizer, which then sends bf16.

A server that dies is restarted from the served model directory and the update group reconnected
(:meth:`RolloutServers.restart`); the driver then re-sends the current weights and retries
(:meth:`megatron_acrl.context.RunContext.push_weights`, :func:`megatron_acrl.rollout.collect_rollouts`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_acrl.config import Config, ConfigError
from sglang_bridge.client import SamplingParams, ServerGoneError, SGLangClient
from sglang_bridge.fp8 import Fp8Scheme, fake_quantize_named_stress, served_fp8_checkpoint
from sglang_bridge.server import ServerSpec, SGLangServer, wait_for_servers
from sglang_bridge.weight_sync import DistributedWeightSynchronizer, Manifest

_FP8_MODE = {"none": 0.0, "real": 1.0, "fake-quant": 2.0}
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


def lm_head_names(served: Iterable[str]) -> tuple[str, ...]:
    """The output projection's HF name among the served tensors: ``lm_head.weight``, or with tied
    embeddings (no such tensor) the embedding table it shares."""
    names = set(served)
    return ("lm_head.weight",) if "lm_head.weight" in names else ("model.embed_tokens.weight",)


def routed_experts_topk(cfg: Config) -> int | None:
    """The top-k to request routed experts with (None: not requested). ``rollout.return_routed_experts``
    None means: when R3 replays them (``model.moe_routing_replay=rollout``); set it true to also get
    the routing metrics with replay off or R2."""
    want = cfg.rollout.return_routed_experts
    if want is None:
        want = cfg.model.moe_routing_replay == "rollout"
    return cfg.model.moe_router_topk if want and cfg.model.is_moe else None


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


async def generate_groups(
    clients: Sequence[Any],
    prompt_ids: Sequence[Sequence[int]],
    params: Any,
    n: int,
) -> list[list[Any]]:
    """``n`` samples per prompt, prompts spread round-robin over ``clients`` (one per server)."""
    shards: list[list[int]] = [[] for _ in clients]
    for i in range(len(prompt_ids)):
        shards[i % len(clients)].append(i)
    results = await asyncio.gather(
        *[
            c.generate([prompt_ids[i] for i in idx], params, n)
            for c, idx in zip(clients, shards, strict=True)
            if idx
        ]
    )
    groups: list[list[Any]] = [[] for _ in prompt_ids]
    for idx, res in zip([s for s in shards if s], results, strict=True):
        for i, g in zip(idx, res, strict=True):
            groups[i] = g
    return groups


class RolloutServers:
    """SGLang servers + clients + weight synchronizer, owned by the driver's rank 0.

    Args:
        cfg: run config.
        model_dir: HF directory the servers serve initially (and restart from); with real FP8 rollout,
            its FP8 copy in ``log_dir``'s parent (the run directory), ``served_fp8/``.
        log_dir: where server logs go.
    """

    def __init__(self, cfg: Config, model_dir: str | Path, log_dir: str | Path):
        self.cfg = cfg
        self.model_dir = str(model_dir)
        self.log_dir = Path(log_dir)
        self.device = resolve_device(cfg)
        self.fp8_mode = resolve_fp8_mode(cfg, self.device)
        r = cfg.rollout
        self.scheme = fp8_scheme(cfg)
        # Stress emulation (truncated / coarser e4m3, quantized routers) is applied here, before the
        # synchronizer, which then sends plain bf16: no FP8 kernel serves those grids.
        self.stress = self.scheme is not None and r.stress_quantization
        check_fp8_mode(cfg, self.fp8_mode)  # before any server starts
        self.api_key = os.environ.get(r.api_key_env) if r.api_key_env else None
        if r.api_key_env and not self.api_key:
            raise RuntimeError(
                f"rollout.api_key_env={r.api_key_env!r} but that environment variable is not set"
            )
        # Real FP8: the servers serve an FP8 copy of the checkpoint in the rollout's scheme (e4m3 +
        # scales + quantization_config, written once into the run directory), and the manifest every
        # sync is validated against is read from that copy. SGLang's online `--quantization fp8` of the
        # bf16 checkpoint would hold per-tensor scales under the bf16 checkpoint's manifest instead,
        # so the e4m3 + weight_scale_inv the bridge sends would match neither.
        self.served_dir = self.model_dir
        if self.scheme is not None and self.fp8_mode == "real":
            self.served_dir = str(
                served_fp8_checkpoint(self.model_dir, self.log_dir.parent / "served_fp8", self.scheme)
            )
        self.servers: list[SGLangServer] = []
        self.restarts = 0
        self.urls = self._start()
        self.synchronizer: DistributedWeightSynchronizer | None = None
        self._connect()

    def _start(self) -> list[str]:
        """Start the local servers and wait until all are healthy, or wait for the launch script's
        (``rollout.server_urls``, started on their own nodes), naming any that never comes up."""
        r = self.cfg.rollout
        if r.server_urls:
            wait_for_servers(list(r.server_urls), timeout_s=r.startup_timeout_s, api_key=self.api_key)
            return list(r.server_urls)
        self.servers = [self._server(i) for i in range(r.num_servers)]
        for s in self.servers:
            s.launch()
        for s in self.servers:
            s.wait_healthy()
        return [s.url for s in self.servers]

    def _server(self, i: int) -> SGLangServer:
        r = self.cfg.rollout
        spec = ServerSpec(
            model_path=self.served_dir,
            device=self.device,  # type: ignore[arg-type]
            host=r.host,
            port=r.base_port + i if r.base_port else None,
            tp=r.server_tp,
            cpus=r.cpus_of_server(i),
            api_key=self.api_key,
            random_seed=self.cfg.training.seed + i,
            return_routed_experts=routed_experts_topk(self.cfg) is not None,
            kv_cache_dtype=r.kv_cache_dtype,
        )
        return SGLangServer(
            spec, self.log_dir / f"sglang_{i}.log", startup_timeout_s=r.startup_timeout_s, name=f"sglang[{i}]"
        )

    def _connect(self) -> None:
        r = self.cfg.rollout
        self.synchronizer = DistributedWeightSynchronizer(
            self.urls,
            Manifest.from_checkpoint(self.served_dir),
            server_tp=r.server_tp,
            api_key=self.api_key,
            device="cuda" if self.device == "cuda" else "cpu",
            bucket_size_mb=r.bucket_size_mb,
            fp8=None if self.stress else self.scheme,
            fp8_mode=self.fp8_mode,  # type: ignore[arg-type]
            timeout_s=r.request_timeout_s,
        )
        self.synchronizer.connect()

    # -- generation -----------------------------------------------------------------------------

    def sampling_params(self, *, greedy: bool = False, seed: int | None = None) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            temperature=0.0 if greedy else r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            seed=seed,
        )

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Any]]:
        """``n`` samples per prompt over all servers; raises :class:`ServerGoneError` if one died."""

        async def run() -> list[list[Any]]:
            clients = [
                SGLangClient(
                    u,
                    api_key=self.api_key,
                    timeout_s=self.cfg.rollout.request_timeout_s,
                    max_concurrency=self.cfg.rollout.max_concurrency,
                    samples_per_request=self.cfg.rollout.samples_per_request,
                    routed_experts_topk=routed_experts_topk(self.cfg),
                )
                for u in self.urls
            ]
            try:
                return await generate_groups(clients, prompt_ids, params, n)
            finally:
                await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)

        return asyncio.run(run())

    def score(self, sequences: Sequence[Sequence[int]], target_lens: Sequence[int]) -> list[list[float]]:
        """The served log-probs of the last ``target_lens[i]`` tokens of each sequence, teacher-forced
        at temperature 1 (:meth:`SGLangClient.score`), from the first server (all hold the same
        weights); raises :class:`ServerGoneError` if it died."""

        async def run() -> list[list[float]]:
            r = self.cfg.rollout
            async with SGLangClient(
                self.urls[0],
                api_key=self.api_key,
                timeout_s=r.request_timeout_s,
                max_concurrency=r.max_concurrency,
            ) as client:
                return await client.score(sequences, target_lens)

        return asyncio.run(run())

    # -- weights ---------------------------------------------------------------------------------

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str, *, quantize: bool = True
    ) -> dict[str, float]:
        """Push one full set of HF-named weights; returns sync metrics (seconds, bytes, mode).
        ``quantize=False`` pushes them unquantized (bf16 servers only: fake-quant and stress)."""
        assert self.synchronizer is not None
        served = self.synchronizer.manifest.tensors

        def to_served(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            # The trainer may hold fp32 masters (fp32 runs); the server holds its --dtype. Casting
            # here is explicit and per tensor; names and shapes are still validated by the bridge.
            for name, t in stream:
                spec = served.get(name)
                if spec is not None and t.is_floating_point() and t.dtype != spec.dtype:
                    t = t.to(spec.dtype)
                yield name, t

        stream = to_served(named_tensors)
        if self.stress and quantize:
            r = self.cfg.rollout
            assert self.scheme is not None
            stream = fake_quantize_named_stress(
                stream,
                self.scheme,
                r.fp8_rounding,
                r.fp8_mantissa_bits,
                quantize_router=r.fp8_quantize_router,
                also=lm_head_names(served) if r.fp8_quantize_lm_head else (),
            )
        report = self.synchronizer.sync(stream, version, quantize=quantize)
        return {
            "sync/seconds": report.seconds,
            "sync/bytes": float(report.num_bytes),
            "sync/tensors": float(report.num_tensors),
            "sync/buckets": float(report.num_buckets),
            # fp8 mode of the rollout copy: 0 none (BF16 rollout), 1 real FP8, 2 fake-quant on a bf16 server
            "sync/fp8_mode": 2.0 if self.stress and quantize else _FP8_MODE[report.fp8],
        }

    # -- failures ----------------------------------------------------------------------------------

    def dead_servers(self) -> list[int]:
        return [i for i, s in enumerate(self.servers) if not s.alive()]

    def restart(self) -> None:
        """Restart dead local servers and reconnect the update group (weights must be re-sent)."""
        if not self.servers:
            raise ServerGoneError(
                f"an external SGLang server ({', '.join(self.urls)}) is gone (launch scripts own those)"
            )
        if self.synchronizer is not None:
            try:
                self.synchronizer.close()
            except Exception:  # noqa: BLE001 - the peer is gone; the group is torn down either way
                pass
        for i in self.dead_servers() or range(len(self.servers)):
            self.servers[i].stop()
            self.servers[i] = self._server(i)
            self.servers[i].start()
        self.urls = [s.url for s in self.servers]
        self.restarts += 1
        self._connect()

    def close(self) -> None:
        if self.synchronizer is not None:
            try:
                self.synchronizer.close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self.synchronizer = None
        for s in self.servers:
            s.stop()
        self.servers = []
