"""Which nodes run the trainer and which run SGLang servers: a pure function of config + request.

Layouts (N = --nodes, G = --gpus-per-node):

* ``driver`` -- one node, CPU (G = 0): all trainer ranks on it; the driver starts its own local
  server(s) on loopback, so the trainer gets no ``rollout.server_urls``.
* ``colocated`` -- one node with GPUs: the job script starts ``rollout.num_servers`` servers on the
  last ``num_servers * server_tp`` GPUs, bound to loopback (no API key); the trainer gets the rest.
* ``dedicated`` -- several nodes: servers get whole nodes at the end of the node list
  (``G // server_tp`` servers per node, or ``--servers-per-node`` on CPU), bound beyond loopback
  with a per-job API key; the trainer gets the first ``N - server_nodes`` nodes, G ranks each.

The trainer's world size is checked against ``parallel.tp * pp * dp`` here, before anything is queued.

Weight sync: ``weight_sync_sources`` trainer ranks send weights to the servers (one per pipeline stage
and EP rank with ``rollout.weight_sync: per_source``). The servers dial each of them, so the job
script gives the trainer nodes ``weight_sync_sources + 1`` consecutive ports per job
(:attr:`JobPlan.weight_sync_ports`: rank 0's control store, then each source's update-group store).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from megatron_acrl.config import Config, ConfigError

ServerMode = Literal["driver", "colocated", "dedicated"]
DEFAULT_API_KEY_ENV = "ACRL_SGLANG_API_KEY"
"""Variable that holds the per-job API key of the servers the job script starts (unless
``rollout.api_key_env`` names another); the driver keys the servers it starts itself."""

DEFAULT_PORT = 30000
"""Port of the first rollout server on a server node when the config leaves ``rollout.base_port`` null
(single-node runs pick free ports instead; server nodes need a port the trainer can be told in advance)."""


@dataclass(frozen=True)
class JobPlan:
    """Resolved node/rank/server layout of one job."""

    nodes: int
    gpus_per_node: int
    trainer_nodes: int
    ranks_per_node: int
    world_size: int
    server_mode: ServerMode
    server_nodes: int
    num_servers: int
    servers_per_node: int
    server_tp: int
    server_host: str
    """Address the servers bind: loopback unless they run on their own nodes."""
    api_key_env: str | None
    """Variable the job script fills with a fresh random key for the servers it starts (None in
    driver mode: the driver makes the key of the servers it starts)."""
    cpus_per_task: int
    weight_sync_sources: int = 1
    """Trainer ranks that send weights to the servers themselves (``Config.weight_sync_sources``)."""

    @property
    def weight_sync_ports(self) -> int:
        """Consecutive ports the weight sync listens on, on the trainer nodes: rank 0's control store
        and one update-group store per source (``rollout.weight_sync_port`` is the first)."""
        return self.weight_sync_sources + 1

    @property
    def trainer_gpus_per_node(self) -> int:
        return 0 if self.gpus_per_node == 0 else self.ranks_per_node

    @property
    def server_gpus_per_node(self) -> int:
        if self.gpus_per_node == 0 or self.server_mode == "driver":
            return 0
        return min(self.num_servers, self.servers_per_node) * self.server_tp

    @property
    def tasks_per_node(self) -> int:
        """Tasks the allocation must hold on its busiest node (trainer ranks + colocated servers)."""
        if self.server_mode == "colocated":
            return self.ranks_per_node + self.num_servers
        if self.server_mode == "dedicated":
            return max(self.ranks_per_node, self.servers_per_node)
        return self.ranks_per_node


@dataclass(frozen=True)
class ServerPlacement:
    """Where the SGLang servers go (the second step of :func:`plan_job`)."""

    mode: ServerMode
    num_servers: int
    server_tp: int
    servers_per_node: int
    server_nodes: int


def plan_job(
    cfg: Config,
    nodes: int,
    gpus_per_node: int,
    ranks_per_node: int | None = None,
    server_nodes: int | None = None,
    servers_per_node: int | None = None,
    cpus_per_task: int = 1,
    servers_in_job: bool = False,
) -> JobPlan:
    """Lay the job out; raise :class:`ConfigError` naming the problem and the fix.

    Steps, each raising the errors it found before the next one runs: the request itself
    (:func:`check_request`), the servers' placement (:func:`place_servers`), the trainer's ranks per
    node (:func:`trainer_ranks_per_node`), and the trainer's world against the parallel layout
    (:func:`check_trainer_world`).
    """
    check_request(cfg, nodes, gpus_per_node, servers_in_job)
    srv = place_servers(cfg, nodes, gpus_per_node, server_nodes, servers_per_node, servers_in_job)
    trainer_nodes = nodes - srv.server_nodes
    rpn = trainer_ranks_per_node(cfg, gpus_per_node, srv, trainer_nodes, ranks_per_node)
    world = trainer_nodes * rpn
    check_trainer_world(cfg, world, trainer_nodes, rpn)
    dedicated = srv.mode == "dedicated"
    return JobPlan(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        trainer_nodes=trainer_nodes,
        ranks_per_node=rpn,
        world_size=world,
        server_mode=srv.mode,
        server_nodes=srv.server_nodes,
        num_servers=srv.num_servers,
        servers_per_node=srv.servers_per_node,
        server_tp=srv.server_tp,
        server_host="0.0.0.0" if dedicated else "127.0.0.1",
        api_key_env=(cfg.rollout.api_key_env or DEFAULT_API_KEY_ENV) if srv.mode != "driver" else None,
        cpus_per_task=cpus_per_task,
        weight_sync_sources=cfg.weight_sync_sources,
    )


def servers_wanted(cfg: Config) -> tuple[int, int]:
    """``(number of servers, tensor-parallel size of each)``; replayed rollouts need no server at
    all: everything is trainer."""
    r = cfg.rollout
    return (0 if r.backend == "replay" else r.num_servers), r.server_tp


def check_request(cfg: Config, nodes: int, gpus_per_node: int, servers_in_job: bool) -> None:
    """The node / GPU counts, and the rollout settings the job script fills in or cannot honour."""
    if nodes < 1:
        raise ConfigError([("--nodes", f"must be >= 1, got {nodes}")])
    if gpus_per_node < 0:
        raise ConfigError([("--gpus-per-node", f"must be >= 0 (0 = CPU job), got {gpus_per_node}")])
    r = cfg.rollout
    n_srv, srv_tp = servers_wanted(cfg)
    G = gpus_per_node
    errors: list[tuple[str, str]] = []
    if r.server_urls:
        errors.append(
            (
                "rollout.server_urls",
                "is filled in by the job script from the node list; remove it from the config/overrides",
            )
        )
    if r.server_cpus and (n_srv == 0 or nodes > 1 or G > 0 or servers_in_job):
        errors.append(
            (
                "rollout.server_cpus",
                "binds only the servers the driver starts itself (a one-node CPU job); the job script's "
                "server step gets its CPUs from SLURM (--cpus-per-task, --exact): set it to []",
            )
        )
    if G and srv_tp > G:
        errors.append(
            (
                "rollout.server_tp",
                f"server_tp={srv_tp} does not fit on a node with {G} GPUs (a server runs on one node); "
                f"lower rollout.server_tp or raise --gpus-per-node",
            )
        )
    _raise(errors)


def place_servers(
    cfg: Config,
    nodes: int,
    gpus_per_node: int,
    server_nodes: int | None,
    servers_per_node: int | None,
    servers_in_job: bool,
) -> ServerPlacement:
    """The server mode (see module doc), servers per node and server nodes; the trainer must keep a
    node, and servers the job script starts need an HF checkpoint."""
    n_srv, srv_tp = servers_wanted(cfg)
    G = gpus_per_node
    errors: list[tuple[str, str]] = []
    mode: ServerMode
    if n_srv == 0:
        mode, spn, s_nodes = "driver", 0, 0
    elif nodes == 1:
        mode = "colocated" if (G > 0 or servers_in_job) else "driver"
        spn, s_nodes = n_srv, 0
    else:
        mode = "dedicated"
        spn = servers_per_node or (G // srv_tp if G else 1)
        needed = math.ceil(n_srv / spn)
        s_nodes = server_nodes if server_nodes is not None else needed
        if s_nodes < needed:
            errors.append(
                (
                    "--server-nodes",
                    f"{n_srv} servers at {spn} per node need {needed} nodes, got {s_nodes}",
                )
            )
    if nodes - s_nodes < 1:
        errors.append(
            (
                "--nodes",
                f"--nodes {nodes} leaves no node for the trainer: the {n_srv} SGLang servers "
                f"(server_tp={srv_tp}, {spn} per node) take {s_nodes} node(s); use --nodes {s_nodes + 1} "
                "or fewer/smaller servers (rollout.num_servers, rollout.server_tp)",
            )
        )
    if mode in ("colocated", "dedicated") and cfg.model.hf_path is None:
        errors.append(
            (
                "model.hf_path",
                f"the job script starts {n_srv} SGLang server(s) ({mode}), which need an HF checkpoint "
                "to serve; set model.hf_path (the trainer pushes its weights to them after start-up)",
            )
        )
    _raise(errors)
    return ServerPlacement(mode, n_srv, srv_tp, spn, s_nodes)


def trainer_ranks_per_node(
    cfg: Config, gpus_per_node: int, srv: ServerPlacement, trainer_nodes: int, ranks_per_node: int | None
) -> int:
    """Trainer ranks per trainer node: one per GPU the servers leave (GPU jobs), else
    ``--ranks-per-node`` or the config's layout."""
    G, p = gpus_per_node, cfg.parallel
    if not G:
        default = p.world_size if (p.world_size and trainer_nodes == 1) else p.tp * p.pp * (p.dp or 1)
        return ranks_per_node or default
    errors: list[tuple[str, str]] = []
    rpn = G - (srv.num_servers * srv.server_tp if srv.mode == "colocated" else 0)
    if rpn < 1:
        errors.append(
            (
                "rollout.num_servers",
                f"{srv.num_servers} servers x server_tp {srv.server_tp} use all {G} GPUs of the node; "
                "leave GPUs for the trainer or use more nodes",
            )
        )
    if ranks_per_node is not None and ranks_per_node != rpn:
        errors.append(("--ranks-per-node", f"GPU jobs run one rank per trainer GPU ({rpn}); drop the flag"))
    _raise(errors)
    return rpn


def check_trainer_world(cfg: Config, world: int, trainer_nodes: int, rpn: int) -> None:
    """The trainer's world size against ``parallel.world_size`` and ``tp * pp * dp``."""
    p = cfg.parallel
    if p.world_size is not None and p.world_size != world:
        raise ConfigError(
            [
                (
                    "parallel.world_size",
                    f"config asks for {p.world_size} trainer ranks but the job has {world} "
                    f"({trainer_nodes} trainer node(s) x {rpn} ranks); set parallel.world_size={world} "
                    "or change --nodes/--gpus-per-node",
                )
            ]
        )
    try:
        p.data_parallel_size(world)
    except ConfigError as err:
        mp = p.tp * p.pp
        fix = f"set parallel.dp={world // mp}" if world % mp == 0 else f"use a multiple of tp*pp={mp} ranks"
        raise ConfigError(
            [
                (
                    "parallel",
                    f"the job has {world} trainer ranks but tp*pp*dp = {p.tp}*{p.pp}*{p.dp or '?'} "
                    f"does not match ({err.errors[0][1]}); {fix}",
                )
            ]
        ) from None


def _raise(errors: list[tuple[str, str]]) -> None:
    if errors:
        raise ConfigError(errors)
