"""What the SLURM cluster offers, read with ``scontrol`` (bounded by a timeout: it hangs when the
controller is down), and the submit-time checks of a job plan against it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from launch.plan import JobPlan

QUERY_TIMEOUT_S = 10.0


class ClusterError(RuntimeError):
    """The cluster cannot run the job as asked (or cannot be asked); the message says how to fix it."""


@dataclass(frozen=True)
class PartitionInfo:
    name: str
    state: str
    nodes: tuple[str, ...]
    gpus_per_node: tuple[int, ...]
    """GPUs (gres ``gpu``) of each node, same order as ``nodes``."""
    cpus_per_node: tuple[int, ...]

    @property
    def max_gpus_per_node(self) -> int:
        return max(self.gpus_per_node, default=0)


def _kv(line: str) -> dict[str, str]:
    # `scontrol -o` prints one record per line as space-separated Key=Value; values we read have no spaces.
    return dict(re.findall(r"(\w+)=(\S*)", line))


def _gpus(gres: str) -> int:
    """GPU count of a node's Gres string, e.g. ``gpu:h100:8(S:0-1),shard:4`` -> 8."""
    return sum(int(n) for n in re.findall(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres))


def scontrol(*args: str) -> str:
    """Run ``scontrol ARGS`` with a timeout; raise :class:`ClusterError` with a useful message."""
    if shutil.which("scontrol") is None:
        raise ClusterError(
            "scontrol not found: submit from a SLURM login node, or use --dry-run --skip-cluster-checks "
            "to only render the script"
        )
    try:
        proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ClusterError(
            f"the SLURM controller did not answer `scontrol {' '.join(args)}` within {QUERY_TIMEOUT_S:.0f} s "
            f"(is slurmctld running? SLURM_CONF={os.environ.get('SLURM_CONF', '<default>')})"
        ) from None
    if proc.returncode != 0:
        raise ClusterError(f"`scontrol {' '.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def partition_info(name: str | None) -> PartitionInfo:
    """The named partition (or the cluster's default one) with its nodes' GPUs and CPUs."""
    parts = [_kv(line) for line in scontrol("show", "partition", "-o").splitlines() if line.strip()]
    names = [p.get("PartitionName", "?") for p in parts]
    if name is None:
        default = [p for p in parts if p.get("Default") == "YES"]
        if not default:
            raise ClusterError(
                f"the cluster has no default partition; pass --partition (one of: {', '.join(names)})"
            )
        part = default[0]
    else:
        match = [p for p in parts if p.get("PartitionName") == name]
        if not match:
            raise ClusterError(
                f"unknown partition {name!r}; this cluster has: {', '.join(names) or '(none)'}"
            )
        part = match[0]
    pname = part["PartitionName"]
    nodes, gpus, cpus = [], [], []
    for line in scontrol("show", "node", "-o").splitlines():
        node = _kv(line)
        if pname in node.get("Partitions", "").split(","):
            nodes.append(node.get("NodeName", "?"))
            gpus.append(_gpus(node.get("Gres", "")))
            cpus.append(int(node.get("CPUTot", "0") or 0))
    return PartitionInfo(pname, part.get("State", "UNKNOWN"), tuple(nodes), tuple(gpus), tuple(cpus))


def check_plan_fits(plan: JobPlan, part: PartitionInfo) -> list[str]:
    """Reasons the partition can never run the plan (empty when it can); each names the fix."""
    problems: list[str] = []
    if part.state != "UP":
        problems.append(f"partition {part.name!r} is {part.state}, not UP; pick another with --partition")
    if plan.nodes > len(part.nodes):
        problems.append(
            f"--nodes {plan.nodes} but partition {part.name!r} has only {len(part.nodes)} node(s) "
            f"({', '.join(part.nodes)}); lower --nodes or pick a bigger partition"
        )
    if plan.gpus_per_node:
        fit = sum(g >= plan.gpus_per_node for g in part.gpus_per_node)
        if part.max_gpus_per_node == 0:
            problems.append(
                f"--gpus-per-node {plan.gpus_per_node} but partition {part.name!r} has no GPUs; "
                "pick a GPU partition with --partition, or --gpus-per-node 0 for a CPU job"
            )
        elif plan.gpus_per_node > part.max_gpus_per_node:
            problems.append(
                f"--gpus-per-node {plan.gpus_per_node} but the nodes of partition {part.name!r} have at most "
                f"{part.max_gpus_per_node} GPUs; lower --gpus-per-node (and the parallel layout with it)"
            )
        elif fit < plan.nodes:
            problems.append(
                f"only {fit} node(s) of partition {part.name!r} have {plan.gpus_per_node} GPUs, "
                f"the job needs {plan.nodes}"
            )
    cpus_needed = plan.tasks_per_node * plan.cpus_per_task
    fit_cpu = sum(c >= cpus_needed for c in part.cpus_per_node)
    if fit_cpu < plan.nodes:
        problems.append(
            f"each node needs {cpus_needed} CPUs ({plan.tasks_per_node} tasks x {plan.cpus_per_task} "
            f"cpus-per-task) but only {fit_cpu} node(s) of partition {part.name!r} have that many "
            f"(CPUs per node: {sorted(set(part.cpus_per_node))}); lower the ranks per node or "
            "--cpus-per-task (the job would otherwise stay pending forever)"
        )
    return problems
