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

:class:`RolloutServers` is the rollout layer's backend
(:class:`megatron_acrl.rollout.backend.RolloutBackend`, implemented structurally). Every generation
request, sync mode's batches of groups (:meth:`RolloutServers.generate`) and the async engine's
batched requests (:meth:`RolloutServers.generate_async`) alike, goes through one dispatch path
(:class:`megatron_acrl.servers.dispatch.Dispatch`: the clients and the in-flight count) to the same
targets (:meth:`RolloutServers.targets`): the server with the fewest samples in flight
(``rollout.router: none``), or the sglang-router the servers sit behind (``rollout.router: sglang``,
started here with the servers' API key), which then picks the server. A server that dies mid-rollout
loses no group of a blocking generation: its groups go to the others (the router retries them
itself), it is taken out of rotation at once, and only after its restart *and* a weight sync
(:meth:`RolloutServers.update_weights`) does it serve again, so a restarted server never samples with
the initial weights.

With ``model.lora.sync: adapter`` the servers run SGLang's LoRA engine (``ServerSpec.lora``) and each
push loads only the adapters, under a versioned name that every later request names
(:meth:`RolloutServers.update_adapter`, :mod:`megatron_acrl.servers.lora_sync`); the base weights
stay as the servers loaded them.
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
from megatron_acrl.servers.dispatch import Dispatch, LoadTally
from megatron_acrl.servers.lora_sync import (
    AdapterSync,
    adapter_mode,
    adapter_sync_for,
    check_adapter_sync,
    fake_quant_base,
    lora_serving_for,
)
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
from sglang_bridge.client import Sample, SamplingParams, ServerGoneError, SGLangClient
from sglang_bridge.fanout import FanOutResult
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

EXTERNAL_REFUSED_S = 10.0
"""A ``rollout.server_urls`` entry that refuses every connection this long is reported at once
(nothing listens there) instead of after the whole ``rollout.startup_timeout_s``."""

CLOSE_PROBE_TIMEOUT_S = 2.0
"""At close, a server that answers no health request this long (twice) is taken as hung and killed
before the update group's teardown: a bound on the way out instead of a full request timeout."""


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
    "consistent_hashing": 5.0,
}
"""``rollout/router_policy``: the routing in effect (least_outstanding is the driver's own fan-out)."""


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
        check_adapter_sync(cfg)
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
        elif self.scheme is not None and adapter_mode(cfg):  # adapters ride on a base quantized once
            self.served_dir = str(fake_quant_base(cfg, self.model_dir, self.log_dir.parent / "served_fp8"))
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
        self.adapters: AdapterSync | None = (
            adapter_sync_for(cfg, self.urls, self.served_dir, self.model_dir, self.api_key)
            if adapter_mode(cfg)
            else None
        )
        """The LoRA adapter versions on the servers (``model.lora.sync: adapter``), else None."""
        self._adapter_restarts = 0  # self.restarts at the last adapter push
        self.router: SGLangRouter | None = None
        self._routed: set[str] = set()  # the URLs the router routes to (hold the current weights)
        self._load = LoadTally({u: k for k, u in enumerate(self.urls)})
        self.dispatch = Dispatch(self._client, self.adapters)
        """The one dispatch path of every generation request (module doc)."""
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
            # The job script waited for them (launch.wait_servers): one that refuses connections now
            # has nothing listening, and waiting the whole startup_timeout_s would not change that.
            wait_for_servers(
                urls, timeout_s=r.startup_timeout_s, api_key=self.api_key, refused_for_s=EXTERNAL_REFUSED_S
            )
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
            lora=lora_serving_for(self.cfg),
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

    def targets(self) -> list[str]:
        """Where generation requests go now: the router alone (``rollout.router: sglang``), else the
        servers still running (a dead one is restarted at the next weight update; all of them when
        none runs, so that the request fails and names them). Raises :class:`ServerGoneError` when
        the router exited."""
        if self.router is not None:
            if not self.router.alive():
                raise ServerGoneError(f"sglang-router exited (log {self.router.log_path})")
            return [self.router.url]
        dead = set(self.dead_servers())
        return [u for i, u in enumerate(self.urls) if i not in dead] or self.urls

    def _cap(self) -> int:
        """Requests one target holds at once: a server's ``rollout.max_concurrency``, or through the
        router every routed server's share together."""
        per = self.cfg.rollout.max_concurrency
        return max(1, per * (len(self._routed) if self.router is not None else 1))

    def _client(self, url: str, cap: int) -> SGLangClient:
        r = self.cfg.rollout
        return SGLangClient(
            url,
            api_key=self.api_key,
            timeout_s=r.request_timeout_s,
            max_concurrency=cap,
            routed_experts_topk=routed_experts_topk(self.cfg),
        )

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        """``n`` samples per prompt over all servers (directly or through the router).

        A server that dies mid-rollout loses no group (see the module doc); raises
        :class:`ServerGoneError` only when no server is left to take them."""
        targets, cap = self.targets(), self._cap()
        per = self.cfg.rollout.samples_per_request

        async def run() -> tuple[FanOutResult, dict[str, float]]:
            def go() -> Any:
                return self.dispatch.fan_out(targets, prompt_ids, params, n, cap=cap, samples_per_request=per)

            try:
                if self.router is None:
                    return await go(), {}
                async with LoadSampler(self.router, on_tick=self._drop_dead_from_router) as loads:
                    result = await go()
                return result, loads.means()
            finally:
                await self.dispatch.aclose()

        result, router_loads = asyncio.run(run())
        self._load.add(result, router_loads, routed=self.router is not None)
        return result.groups

    def generate_async(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *, affinity: str | None = None
    ) -> asyncio.Future[list[Sample]]:
        """One batched request (one sample per prompt) sent now from the running event loop, through
        the same targets, clients and count as :meth:`generate`; the future holds the samples, or
        the error (a dead router's :class:`ServerGoneError` too)."""
        try:
            targets = self.targets()
        except ServerGoneError as e:
            failed: asyncio.Future[list[Sample]] = asyncio.get_running_loop().create_future()
            failed.set_exception(e)
            return failed
        # sglang-router takes one prompt per /generate (a group's samples as one request with n)
        return self.dispatch.send(
            targets, prompt_ids, params, cap=self._cap(), batched=self.router is None, affinity=affinity
        )

    def unpin(self, affinity: str) -> None:
        """Forget ``affinity``'s server: its trajectory ended (:meth:`Dispatch.unpin`)."""
        self.dispatch.unpin(affinity)

    def in_flight(self) -> dict[str, int]:
        """Samples in flight on each dispatch target: the router, or every server (dead ones too)."""
        return self.dispatch.in_flight([self.router.url] if self.router is not None else self.urls)

    async def aclose(self) -> None:
        """Close the calling event loop's clients (the async engine, when it stops)."""
        await self.dispatch.aclose()

    def pause(self, mode: str = "retract") -> None:
        """Pause generation on every live server (``rollout.pause_mode``'s modes); a weight sync
        pauses and continues on its own."""
        if self.adapters is not None:  # an unload now would wait on the retracted requests
            self.adapters.paused = True
        self._each_live_server(lambda c: c.pause_generation(mode))  # type: ignore[arg-type]

    def resume(self) -> None:
        """Continue generation on every live server."""
        self._each_live_server(lambda c: c.continue_generation())
        if self.adapters is not None:
            self.adapters.paused = False

    def _each_live_server(self, call: Any) -> None:
        dead = set(self.dead_servers())
        urls = [u for i, u in enumerate(self.urls) if i not in dead]

        async def run() -> None:
            try:
                await asyncio.gather(*(call(self.dispatch.client(u, 1)) for u in urls))
            finally:
                await self.dispatch.aclose()

        asyncio.run(run())

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

        adapter = self.adapters.acquire() if self.adapters is not None else None

        async def run() -> list[list[float]]:
            try:
                client = self.dispatch.client(self.urls[0], self.cfg.rollout.max_concurrency)
                return await client.score(sequences, target_lens, lora_path=adapter)
            finally:
                await self.dispatch.aclose()

        try:
            return asyncio.run(run())
        finally:
            if self.adapters is not None:
                self.adapters.release(adapter)

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

    def update_adapter(self, adapter: dict[str, torch.Tensor], version: str) -> dict[str, float]:
        """Load the LoRA adapter (PEFT names -> full tensors, rank 0 holds all) as weight version
        ``version`` on every server and send new requests to it (:class:`AdapterSync`); dead
        servers are restarted first and get it too. Returns sync metrics."""
        assert self.adapters is not None, "update_adapter needs model.lora.sync=adapter"
        if self.dead_servers():
            self.restart()
        # fresh servers (a restart here or by the recovery since the last push) hold no adapter yet
        self.adapters.servers_changed(self.urls, restarted=self.restarts != self._adapter_restarts)
        metrics = self.adapters.push(adapter, version)
        self._adapter_restarts = self.restarts
        self._sync_router()
        return {**metrics, "sync/adapter": 1.0}

    def close(self) -> None:
        """Stop the router, leave the update group, stop the servers. A hung server would hold the
        group's teardown (``destroy_weights_update_group``) for a full request timeout, so hung ones
        are killed first: the teardown's request to them is then refused at once."""
        if self.router is not None:
            self.router.stop()
            self.router = None
        if self.adapters is not None:
            self.adapters.close()
        if self.synchronizer is not None:
            for i, why in self.hung_servers(CLOSE_PROBE_TIMEOUT_S).items():
                s = self.servers[i]
                log.warning(
                    "rollout server %s (pid %s) is hung at close (%s): killing it", s.name, s.pid, why
                )
                s.stop(grace_s=0.0)
            try:
                self.synchronizer.close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self.synchronizer = None
        for s in self.servers:
            s.stop()
        self.servers = []
