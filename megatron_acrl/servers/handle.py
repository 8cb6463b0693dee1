"""The driver's handle on its rollout servers (rank 0 only): SGLang processes, generation fan-out,
weight updates, restarts.

On a single node :class:`RolloutServers` starts ``rollout.num_servers`` local SGLang servers from
the served model directory; multi-node launch scripts start servers on their own nodes and pass
``rollout.server_urls``. Weights go through the bridge's
:class:`sglang_bridge.weight_sync.DistributedWeightSynchronizer`: FP8 is real (e4m3 + scales) on GPU
servers and *fake-quant* (FP8 rounding served in bf16) on CPU servers, which cannot run FP8 kernels;
the mode is reported in every update's ``sync/*`` metrics. The stress emulations (truncated or
coarser e4m3, quantized routers) are applied before the synchronizer (:func:`weights_for_servers`,
on every source), which then sends bf16.

With ``rollout.weight_sync: per_source`` every pipeline stage's and EP rank's source sends its own
weights (:func:`open_weight_source`, :func:`push_from_source` on the other ranks); rank 0's
synchronizer coordinates them over a control store it hosts (:attr:`RolloutServers.control`).

A server that dies is restarted from the served model directory and the update group reconnected
(:meth:`RolloutServers.restart`); one that hangs during a weight sync (a timeout, and no answer to a
health request, or stopped) has its process tree killed and is replaced the same way
(:mod:`megatron_acrl.servers.recovery`); the driver then re-sends the current weights and retries
(:meth:`megatron_acrl.servers.publisher.WeightPublisher.push`,
:func:`megatron_acrl.rollout.phase.collect_rollouts`).

A run owns what it starts: its servers and its clients hold one key (:func:`run_api_key`: the one
``rollout.api_key_env`` names, else a random one made at start and held in memory only), exposed as
:attr:`RolloutServers.api_key`. The run uses only servers it started or was given in
``rollout.server_urls``, and those only when they answer with its key and refuse anyone without it;
a fixed ``rollout.base_port`` another process holds is refused, naming that process.

Generation fans the groups out (:func:`generate_groups`): one request per group (a prompt's n
samples), either to the server with the fewest requests in flight (``rollout.router: none``) or
through an sglang-router the servers sit behind (``rollout.router: sglang``, started here with the
servers' API key). A server that dies mid-rollout loses no group: its groups go to the others (the
router retries them itself), it is taken out of rotation at once, and only after its restart *and*
a weight sync (:meth:`RolloutServers.update_weights`) does it serve again, so a restarted server
never samples with the initial weights.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_acrl.config import Config, ConfigError, RolloutConfig
from megatron_acrl.servers.recovery import ServerRecovery
from megatron_acrl.servers.transfer import (
    Meta,
    check_fp8_mode,
    fp8_scheme,
    meta_for_servers,
    resolve_device,
    resolve_fp8_mode,
    sync_address,
    weights_for_servers,
)
from sglang_bridge.client import SamplingParams, ServerGoneError, SGLangClient
from sglang_bridge.fanout import FanOutResult, fan_out
from sglang_bridge.fp8 import served_fp8_checkpoint
from sglang_bridge.listeners import port_holder, port_is_free
from sglang_bridge.router import LoadSampler, RouterSpec, SGLangRouter
from sglang_bridge.server import (
    PortInUse,
    ServersNotReady,
    ServerSpec,
    SGLangServer,
    answers_anonymous,
    wait_for_servers,
)
from sglang_bridge.server_key import new_api_key
from sglang_bridge.weight_sync import ControlStore, DistributedWeightSynchronizer, Manifest

_FP8_MODE = {"none": 0.0, "real": 1.0, "fake-quant": 2.0}
log = logging.getLogger(__name__)


def run_api_key(cfg: Config) -> str:
    """The key of this run's servers: the value of the variable ``rollout.api_key_env`` names, else a
    random one made now (a run always keys its servers, on loopback too)."""
    env = cfg.rollout.api_key_env
    if env is None:
        return new_api_key()
    key = os.environ.get(env, "")
    if not key:
        raise ConfigError(
            [("rollout.api_key_env", f"names {env}, which is not set; export the servers' key in it")]
        )
    if key.startswith("-"):  # SGLang would read it as an option (sglang_bridge.server_key.new_api_key)
        raise ConfigError(
            [("rollout.api_key_env", f"the key in {env} begins with '-'; use one that does not")]
        )
    return key


def port_held(port: int, holder: str, what: str | None = None) -> ServersNotReady:
    """The error of a fixed server port that another process holds (``rollout.base_port``)."""
    what = what or f"port {port} is held by {holder}, which this run did not start"
    return ServersNotReady(
        f"rollout.base_port: {what}. This run uses only servers it starts or is given in "
        "rollout.server_urls (with their key in rollout.api_key_env); unset rollout.base_port to pick "
        "free ports, or choose others",
        {f"port {port}": holder},
    )


def check_ports(cfg: Config) -> None:
    """Before anything is built: raise :func:`port_held` for a fixed server port another process
    holds (the servers' own start checks again, at launch)."""
    r = cfg.rollout
    if r.server_urls or not r.base_port or r.backend != "sglang":
        return
    for port in range(r.base_port, r.base_port + r.num_servers):
        if not port_is_free(r.host, port):
            raise port_held(port, port_holder(port))


def routed_experts_topk(cfg: Config) -> int | None:
    """The top-k to request routed experts with (None: not requested). ``rollout.return_routed_experts``
    None means: when R3 replays them (``model.moe_routing_replay=rollout``); set it true to also get
    the routing metrics with replay off or R2."""
    want = cfg.rollout.return_routed_experts
    if want is None:
        want = cfg.model.moe_routing_replay == "rollout"
    return cfg.model.moe_router_topk if want and cfg.model.is_moe else None


ROUTING_POLICY_CODE = {
    "least_outstanding": 0.0,
    "cache_aware": 1.0,
    "power_of_two": 2.0,
    "round_robin": 3.0,
    "random": 4.0,
}
"""``rollout/router_policy``: the routing in effect (least_outstanding is the driver's own fan-out)."""


async def generate_groups(
    clients: Sequence[Any],
    prompt_ids: Sequence[Sequence[int]],
    params: Any,
    n: int,
    *,
    max_in_flight: int = 64,
    samples_per_request: int | None = None,
) -> FanOutResult:
    """``n`` samples per prompt, one request per group, each to the client (a server, or the router)
    with the fewest requests in flight (:func:`sglang_bridge.fanout.fan_out`); ``result.groups[i]``
    holds prompt i's samples."""
    return await fan_out(
        clients, prompt_ids, params, n, max_in_flight=max_in_flight, samples_per_request=samples_per_request
    )


def router_spec(r: RolloutConfig, urls: Sequence[str], api_key: str | None) -> RouterSpec:
    """The sglang-router in front of ``urls``: ``rollout.router_policy``, its port, the servers' key and
    ``rollout.router_timeout_s`` (else request_timeout_s) in the whole seconds the router takes."""
    return RouterSpec(
        worker_urls=tuple(urls),
        policy=r.router_policy,
        port=r.router_port,
        api_key=api_key,
        request_timeout_s=max(1, round(r.router_request_timeout_s)),
    )


class RolloutServers(ServerRecovery):
    """SGLang servers + clients + weight synchronizer, owned by the driver's rank 0; what it does
    when they fail is :class:`~megatron_acrl.servers.recovery.ServerRecovery`'s.

    Args:
        cfg: run config.
        model_dir: HF directory the servers serve initially (and restart from); with real FP8 rollout,
            its FP8 copy in ``log_dir``'s parent (the run directory), ``served_fp8/``.
        log_dir: where server logs go.
    """

    def __init__(
        self,
        cfg: Config,
        model_dir: str | Path,
        log_dir: str | Path,
        *,
        source_label: str = "",
        single_node: bool = True,
    ):
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
        self._api_key = run_api_key(cfg)
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
        self.hung_restarts = 0
        """Servers killed and replaced because they hung during a weight sync (``sync/hung_restarts``)."""
        self.source_label = source_label
        self.address = sync_address(cfg, single_node)
        self.control: ControlStore | None = None
        """Where the other sources of a per-source sync meet rank 0's synchronizer (several only)."""
        if cfg.weight_sync_sources > 1:
            port = r.weight_sync_port or 0
            self.control = ControlStore.host(self.address, port, timeout_s=r.sync_timeout_s)
        self.urls = self._start()
        self.synchronizer: DistributedWeightSynchronizer | None = None
        self._connect()
        self.router: SGLangRouter | None = None
        self._routed: set[str] = set()  # the URLs the router routes to (hold the current weights)
        self._load = _LoadTally({u: k for k, u in enumerate(self.urls)})
        if r.router == "sglang":
            self.router = self._start_router()

    @property
    def api_key(self) -> str:
        """The run's key: what its servers demand and its clients (and a router in front) send."""
        return self._api_key

    def _start(self) -> list[str]:
        """Start the local servers and wait until all are healthy, or wait for the launch script's
        (``rollout.server_urls``, started on their own nodes), naming any that never comes up, that
        refuses the run's key or that answers without one."""
        r = self.cfg.rollout
        if r.server_urls:
            urls = list(r.server_urls)
            wait_for_servers(urls, timeout_s=r.startup_timeout_s, api_key=self.api_key)
            if open_ := {u: "answers without an API key" for u in urls if answers_anonymous(u)}:
                raise ServersNotReady(
                    f"rollout.server_urls: {', '.join(open_)} answer(s) requests without an API key, so "
                    "anyone who can reach them can replace the weights this run trains on; start them "
                    "with the key of rollout.api_key_env",
                    open_,
                )
            return urls
        self.servers = [self._server(i) for i in range(r.num_servers)]
        try:
            for s in self.servers:
                s.launch()
        except PortInUse as e:
            for s in self.servers:
                s.stop()
            raise port_held(e.port, e.holder, str(e)) from e
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

    def _start_router(self) -> SGLangRouter:
        """sglang-router in front of every server, on loopback, holding the servers' API key."""
        r = self.cfg.rollout
        spec = router_spec(r, self.urls, self.api_key)
        router = SGLangRouter(spec, self.log_dir / "router.log", startup_timeout_s=r.startup_timeout_s)
        router.start()
        self._routed = set(self.urls)
        return router

    def _restart_router(self) -> None:
        """A fresh router in front of every server (their weights are current: after a sync, or a
        router that died while the servers lived)."""
        assert self.router is not None
        log.warning("sglang-router exited; starting a new one. Its log: %s", self.router.log_tail(10))
        self.router.stop()
        self.router = self._start_router()

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
            pause_mode=r.pause_mode,  # what requests in flight do during an update (async RL)
            timeout_s=r.sync_timeout_s,
            master_address=self.address,
            master_port=r.weight_sync_port + 1 if r.weight_sync_port else None,
            sources=self.cfg.weight_sync_sources,
            control=self.control,
            source_label=self.source_label,
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
        """``n`` samples per prompt over all servers (directly or through the router).

        A server that dies mid-rollout loses no group (see the module doc); raises
        :class:`ServerGoneError` only when no server is left to take them."""
        r = self.cfg.rollout
        if self.router is not None and not self.router.alive():
            raise ServerGoneError(f"sglang-router exited (log {self.router.log_path})")
        # Through the router: one client with every server's share of requests in flight. Direct:
        # the servers still running (a dead one is restarted at the next weight update).
        dead = set(self.dead_servers())
        live = [u for i, u in enumerate(self.urls) if i not in dead] or self.urls
        targets = [self.router.url] if self.router is not None else live
        cap = r.max_concurrency * (len(self._routed) if self.router is not None else 1)

        async def run() -> tuple[FanOutResult, dict[str, float]]:
            clients = [
                SGLangClient(
                    u,
                    api_key=self.api_key,
                    timeout_s=r.request_timeout_s,
                    max_concurrency=max(cap, 1),
                    routed_experts_topk=routed_experts_topk(self.cfg),
                )
                for u in targets
            ]
            try:
                kw = dict(max_in_flight=max(cap, 1), samples_per_request=r.samples_per_request)
                if self.router is None:
                    return await generate_groups(clients, prompt_ids, params, n, **kw), {}
                async with LoadSampler(self.router, on_tick=self._drop_dead_from_router) as loads:
                    result = await generate_groups(clients, prompt_ids, params, n, **kw)
                return result, loads.means()
            finally:
                await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)

        result, router_loads = asyncio.run(run())
        self._load.add(result, router_loads, routed=self.router is not None)
        return result.groups

    def load_metrics(self) -> dict[str, float]:
        """Routing and per-server load since the last call (then reset): ``rollout/router_policy``
        (:data:`ROUTING_POLICY_CODE`), ``rollout/server_load/<k>`` (mean requests in flight on
        server k while generating; sampled from the router's counters under sglang-router),
        ``rollout/server_samples/<k>`` (direct fan-out), ``rollout/load_imbalance`` (busiest server's
        load over the mean), ``rollout/requeued`` (requests re-sent after their server failed or timed
        out), ``rollout/timeouts`` (requests that timed out on a live server and were sent again)."""
        r = self.cfg.rollout
        policy = r.router_policy if self.router is not None else "least_outstanding"
        return {"rollout/router_policy": ROUTING_POLICY_CODE[policy], **self._load.take()}

    async def _drop_dead_from_router(self) -> None:
        """Take servers whose process died out of the router's rotation right away (its own health
        checks would take seconds, retrying requests on them meanwhile)."""
        assert self.router is not None
        for i in self.dead_servers():
            url = self.servers[i].url
            if url in self._routed:
                self._routed.discard(url)
                await asyncio.to_thread(self.router.remove_worker, url)

    def _sync_router(self) -> None:
        """After a weight sync every server holds the current weights: put the ones the router does
        not route to (restarted servers) back in, and drop dead ones."""
        if self.router is None:
            return
        if not self.router.alive():
            self._restart_router()
            return
        for url in set(self._routed) - set(self.urls):
            self.router.remove_worker(url)
            self._routed.discard(url)
        for url in self.urls:
            if url not in self._routed:
                self.router.add_worker(url)
                self._routed.add(url)

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
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: str,
        *,
        quantize: bool = True,
        meta: Meta | None = None,
    ) -> dict[str, float]:
        """Push one full set of HF-named weights (rank 0's own, with ``meta`` their metadata; with
        several sources, the others push theirs at the same time); returns sync metrics (seconds,
        bytes, mode). ``quantize=False`` pushes them unquantized (bf16 servers only: fake-quant and
        stress)."""
        if self.dead_servers():  # a server died while generating (its groups went elsewhere)
            self.restart()
        assert self.synchronizer is not None
        stream = weights_for_servers(self.cfg, named_tensors, quantize=quantize)
        declared = meta_for_servers(meta) if meta is not None else None
        report = self.synchronizer.sync(stream, version, quantize=quantize, meta=declared)
        self._sync_router()  # restarted servers hold the current weights now: route to them again
        metrics = {
            "sync/seconds": report.seconds,
            "sync/bytes": float(report.num_bytes),
            "sync/tensors": float(report.num_tensors),
            "sync/buckets": float(report.num_buckets),
            # fp8 mode of the rollout copy: 0 none (BF16 rollout), 1 real FP8, 2 fake-quant on a bf16 server
            "sync/fp8_mode": 2.0 if self.stress and quantize else _FP8_MODE[report.fp8],
        }
        if report.sources:
            # The busiest source's share of the bytes: 1 / sources when the stages are even.
            metrics["sync/sources"] = float(len(report.sources))
            metrics["sync/busiest_source_share"] = max(report.sources.values()) / max(report.num_bytes, 1)
        return metrics

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        if self.synchronizer is not None:
            try:
                self.synchronizer.close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self.synchronizer = None
        for s in self.servers:
            s.stop()
        self.servers = []


class _LoadTally:
    """Per-server load of the fan-outs since the last :meth:`take` (``index``: URL -> server k)."""

    def __init__(self, index: dict[str, int]):
        self.index = index
        self._clear()

    def _clear(self) -> None:
        self.seconds = 0.0
        self.load_s: dict[int, float] = {}
        self.samples: dict[int, float] = {}
        self.requeued = 0
        self.timeouts = 0

    def add(self, result: FanOutResult, router_loads: dict[str, float], routed: bool) -> None:
        self.seconds += result.seconds
        self.requeued += result.requeued
        self.timeouts += result.timeouts
        if routed:  # through the router: its sampled per-worker counts (0 where none was seen)
            for url, k in self.index.items():
                self.load_s[k] = self.load_s.get(k, 0.0) + router_loads.get(url, 0.0) * result.seconds
            return
        for st in result.stats:
            k = self.index.get(st.url)
            if k is not None:
                self.load_s[k] = self.load_s.get(k, 0.0) + st.load_s
                self.samples[k] = self.samples.get(k, 0.0) + st.samples

    def take(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.seconds > 0 and self.load_s:
            loads = {k: v / self.seconds for k, v in sorted(self.load_s.items())}
            out.update({f"rollout/server_load/{k}": v for k, v in loads.items()})
            mean = sum(loads.values()) / len(loads)
            out["rollout/load_imbalance"] = max(loads.values()) / mean if mean > 0 else 1.0
        out.update({f"rollout/server_samples/{k}": v for k, v in sorted(self.samples.items())})
        out["rollout/requeued"] = float(self.requeued)
        out["rollout/timeouts"] = float(self.timeouts)
        self._clear()
        return out
