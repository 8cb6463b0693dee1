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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from megatron_acrl.config import Config, ConfigError

ServerMode = Literal["driver", "colocated", "dedicated"]
DEFAULT_API_KEY_ENV = "ACRL_SGLANG_API_KEY"


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
    """Variable the job script fills with a fresh random key (only for non-loopback servers)."""
    cpus_per_task: int

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
    """Lay the job out; raise :class:`ConfigError` naming the problem and the fix."""
    errors: list[tuple[str, str]] = []
    if nodes < 1:
        raise ConfigError([("--nodes", f"must be >= 1, got {nodes}")])
    if gpus_per_node < 0:
        raise ConfigError([("--gpus-per-node", f"must be >= 0 (0 = CPU job), got {gpus_per_node}")])
    r, p = cfg.rollout, cfg.parallel
    if r.backend == "replay":
        # Replayed rollouts need no server at all: everything is trainer.
        n_srv, srv_tp = 0, r.server_tp
    else:
        n_srv, srv_tp = r.num_servers, r.server_tp
    if r.server_urls:
        errors.append(
            (
                "rollout.server_urls",
                "is filled in by the job script from the node list; remove it from the config/overrides",
            )
        )

    G = gpus_per_node
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

    # -- servers ---------------------------------------------------------------------------
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
    trainer_nodes = nodes - s_nodes
    if trainer_nodes < 1:
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

    # -- trainer ranks ---------------------------------------------------------------------
    if G:
        rpn = G - (n_srv * srv_tp if mode == "colocated" else 0)
        if rpn < 1:
            errors.append(
                (
                    "rollout.num_servers",
                    f"{n_srv} servers x server_tp {srv_tp} use all {G} GPUs of the node; "
                    "leave GPUs for the trainer or use more nodes",
                )
            )
        if ranks_per_node is not None and ranks_per_node != rpn:
            errors.append(
                ("--ranks-per-node", f"GPU jobs run one rank per trainer GPU ({rpn}); drop the flag")
            )
    else:
        default = p.world_size if (p.world_size and trainer_nodes == 1) else p.tp * p.pp * (p.dp or 1)
        rpn = ranks_per_node or default
    _raise(errors)
    world = trainer_nodes * rpn
    if p.world_size is not None and p.world_size != world:
        errors.append(
            (
                "parallel.world_size",
                f"config asks for {p.world_size} trainer ranks but the job has {world} "
                f"({trainer_nodes} trainer node(s) x {rpn} ranks); set parallel.world_size={world} "
                "or change --nodes/--gpus-per-node",
            )
        )
    _raise(errors)
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

    dedicated = mode == "dedicated"
    return JobPlan(
        nodes=nodes,
        gpus_per_node=G,
        trainer_nodes=trainer_nodes,
        ranks_per_node=rpn,
        world_size=world,
        server_mode=mode,
        server_nodes=s_nodes,
        num_servers=n_srv,
        servers_per_node=spn,
        server_tp=srv_tp,
        server_host="0.0.0.0" if dedicated else "127.0.0.1",
        api_key_env=(r.api_key_env or DEFAULT_API_KEY_ENV) if dedicated else None,
        cpus_per_task=cpus_per_task,
    )


def _raise(errors: list[tuple[str, str]]) -> None:
    if errors:
        raise ConfigError(errors)
