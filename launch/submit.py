"""Submit an RL run to SLURM: check everything that can be checked, render the job script, ``sbatch``.

    python -m launch.submit configs/qwen2.5-7b-gsm8k.yaml --nodes 4 --gpus-per-node 8 --partition gpu \\
        --time 24:00:00 [section.key=value ...] [--dry-run]

Before anything is queued: the config is loaded and validated (exit 2 with its message), the files
it reads must exist here (``Config.check_paths``) and pass the trainer's own input checks (the task's
data, the tokenizer, every prompt's length: :func:`megatron_acrl.run.preflight.check_inputs`), the
node layout must fit the parallel layout (:mod:`launch.plan`) and the partition
(:mod:`launch.cluster`: unknown partition, more nodes or GPUs or CPUs per node than it has).
Then the resolved config is frozen into ``<output-dir>/<job-name>/submitted-config.yaml`` (a
requeued run reads exactly what was submitted), the script from ``launch/templates/job.sbatch``
is written next to it and submitted.

Everything of the job lives under ``<output-dir>/<job-name>/``: ``logs/job-<id>.out`` (the script
and every trainer rank, prefixed by rank), ``logs/server-<i>.log``, ``checkpoints/``, ``wandb/``,
``status`` (last word of the script: RUNNING / COMPLETED / REQUEUED / FAILED rc=...). Submitting
again with the same job name resumes from its checkpoints. The directory is 0700 and its files 0600
(the job runs under ``umask 077``); the servers' per-job key is made when the job runs and lives in
its environment only, so neither the script nor ``--dry-run`` ever shows it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from launch.cluster import ClusterError, check_plan_fits, partition_info
from launch.plan import DEFAULT_PORT, JobPlan, plan_job
from megatron_acrl.config import Config, ConfigError, config_to_dict, exit_codes, load_config, parse_overrides
from megatron_acrl.run.preflight import check_inputs

TEMPLATE = Path(__file__).with_name("templates") / "job.sbatch"
WRAPPER = Path(__file__).with_name("rank_wrapper.sh")
REPO_ROOT = Path(__file__).resolve().parents[1]


class SubmitError(RuntimeError):
    """A submit-time problem; nothing was queued."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m launch.submit",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("config", help="YAML config (configs/X.yaml)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.num_steps=100")
    ap.add_argument("--nodes", type=int, default=1, help="nodes of the job (trainer + server nodes)")
    ap.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node; 0 runs a CPU job")
    ap.add_argument("--partition", default=None, help="SLURM partition; default: the cluster's default")
    ap.add_argument("--time", default=None, help="time limit (SLURM format, e.g. 24:00:00)")
    ap.add_argument("--account", default=None, help="SLURM account")
    ap.add_argument("--job-name", default=None, help="job name; default: the config file's stem")
    ap.add_argument(
        "--output-dir", default="runs/slurm", help="logs and checkpoints go to OUTPUT_DIR/JOB_NAME"
    )
    ap.add_argument("--dry-run", action="store_true", help="print the job script instead of submitting it")
    ap.add_argument(
        "--skip-cluster-checks",
        action="store_true",
        help="do not ask SLURM about the partition (render anywhere)",
    )
    ap.add_argument(
        "--launcher",
        choices=["srun", "torchrun"],
        default="srun",
        help="one srun task per rank, or torchrun per node",
    )
    ap.add_argument("--entry-module", default="megatron_acrl.train", help="trainer module run as `python -m`")
    ap.add_argument(
        "--server-module", default="launch.serve", help="server module run as `python -m` on server nodes"
    )
    ap.add_argument(
        "--python", default=sys.executable, help="Python interpreter on the nodes (shared filesystem)"
    )
    ap.add_argument("--ranks-per-node", type=int, default=None, help="CPU jobs: trainer ranks per node")
    ap.add_argument("--cpus-per-task", type=int, default=1, help="CPUs per trainer rank / server")
    ap.add_argument(
        "--server-nodes", type=int, default=None, help="nodes for SGLang servers (multi-node jobs)"
    )
    ap.add_argument(
        "--servers-per-node", type=int, default=None, help="servers per server node (default G // server_tp)"
    )
    ap.add_argument(
        "--servers-in-job",
        action="store_true",
        help="single-node CPU jobs: the job script starts the servers (default: the driver does)",
    )
    ap.add_argument(
        "--server-timeout",
        type=float,
        default=None,
        help="seconds to wait for servers (default rollout.startup_timeout_s)",
    )
    ap.add_argument(
        "--signal-secs", type=int, default=300, help="SIGTERM this many seconds before the time limit"
    )
    ap.add_argument("--max-requeues", type=int, default=20, help="stop requeueing after this many restarts")
    ap.add_argument(
        "--sbatch-arg", action="append", default=[], help="extra sbatch option, e.g. --exclusive (repeatable)"
    )
    # Intermixed: overrides may come before or after the flags.
    return ap.parse_intermixed_args(argv)


def _time_to_secs(t: str) -> int | None:
    """SLURM time string ([D-]HH:MM:SS, MM:SS, MM, D-HH[:MM]) in seconds; None if unparseable/unlimited."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t.strip())
    if not m:
        return None
    d, a, b, c = (int(x) if x else None for x in m.groups())
    if d is not None:  # D-HH[:MM[:SS]]
        return d * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:
        return a * 3600 + b * 60 + c
    if b is not None:
        return a * 60 + b
    return a * 60


def resolve_config(args: argparse.Namespace, run_dir: Path) -> Config:
    """The config the job runs: file + overrides, with checkpoints and W&B files under ``run_dir``."""
    cfg = load_config(args.config, args.overrides)
    cfg.check_paths()
    inputs = check_inputs(cfg)  # data, tokenizer, prompt lengths: what the trainer's pre-flight reads
    if inputs:
        raise ConfigError(inputs)
    given = parse_overrides(args.overrides)
    job: list[str] = ["training.resume=true"]
    # Checkpoints belong to the job (the requeued run resumes from them) unless explicitly overridden.
    if "checkpoint_dir" not in given.get("training", {}):
        job.append(f"training.checkpoint_dir={run_dir / 'checkpoints'}")
    if "wandb_dir" not in given.get("logging", {}):
        job.append(f"logging.wandb_dir={run_dir / 'wandb'}")
    return load_config(args.config, [*args.overrides, *job])


def render(args: argparse.Namespace, cfg: Config, plan: JobPlan, run_dir: Path, config_path: Path) -> str:
    """The job script text."""
    q = shlex.quote
    sb = [
        f"--job-name={args.job_name}",
        f"--nodes={plan.nodes}",
        f"--ntasks-per-node={plan.tasks_per_node}",
        f"--cpus-per-task={plan.cpus_per_task}",
        f"--output={run_dir}/logs/job-%j.out",
        f"--chdir={Path.cwd()}",
    ]
    if plan.gpus_per_node:
        sb.append(f"--gpus-per-node={plan.gpus_per_node}")
    if args.partition:
        sb.append(f"--partition={args.partition}")
    if args.time:
        sb.append(f"--time={args.time}")
    if args.account:
        sb.append(f"--account={args.account}")
    sb += args.sbatch_arg
    gpu_flags_trainer = [f"--gres=gpu:{plan.trainer_gpus_per_node}"] if plan.gpus_per_node else []
    gpu_flags_server = [f"--gres=gpu:{plan.server_gpus_per_node}"] if plan.server_gpus_per_node else []
    timeout = args.server_timeout if args.server_timeout is not None else cfg.rollout.startup_timeout_s
    variables = {
        "RUN_DIR": str(run_dir),
        "WORKDIR": str(Path.cwd()),
        "CONFIG": str(config_path),
        "CHECKPOINT_DIR": str(cfg.training.checkpoint_dir),
        "PYTHON": args.python,
        "ENTRY_MODULE": args.entry_module,
        "SERVER_MODULE": args.server_module,
        "WRAPPER": str(WRAPPER),
        "LAUNCHER": args.launcher,
        "TRAINER_NODES": str(plan.trainer_nodes),
        "RANKS_PER_NODE": str(plan.ranks_per_node),
        "WORLD_SIZE": str(plan.world_size),
        "CPUS_PER_TASK": str(plan.cpus_per_task),
        "SERVER_MODE": plan.server_mode,
        "SERVER_NODES": str(plan.server_nodes),
        "NUM_SERVERS": str(plan.num_servers),
        "SERVERS_PER_NODE": str(max(plan.servers_per_node, 1)),
        "SERVER_HOST": plan.server_host,
        "BASE_PORT": str(cfg.rollout.base_port or DEFAULT_PORT),
        "API_KEY_ENV": plan.api_key_env or "",
        "WEIGHT_SYNC_PORTS": str(plan.weight_sync_ports),
        "WEIGHT_SYNC_PORT_FIXED": str(cfg.rollout.weight_sync_port or ""),
        "SERVER_TIMEOUT": f"{timeout:g}",
        "MAX_REQUEUES": str(args.max_requeues),
        "LAUNCH_ERROR": str(exit_codes.LAUNCH_ERROR),
        "SERVERS_UNAVAILABLE": str(exit_codes.SERVERS_UNAVAILABLE),
        "REQUEUE_LIMIT": str(exit_codes.REQUEUE_LIMIT),
    }
    lines = [f"{k}={q(v)}" for k, v in variables.items()]
    lines.append(f"SERVER_SRUN_FLAGS=({' '.join(q(f) for f in gpu_flags_server)})")
    lines.append(f"TRAINER_SRUN_FLAGS=({' '.join(q(f) for f in gpu_flags_trainer)})")
    values = {
        "COMMAND_LINE": "python -m launch.submit " + " ".join(q(a) for a in (args.argv or [])),
        "SBATCH_LINES": "\n".join(f"#SBATCH {line}" for line in sb),
        "SIGNAL_SECS": str(args.signal_secs),
        "VARIABLES": "\n".join(lines),
        "DESCRIBE_RC": exit_codes.bash_describe_function(),
    }
    text = TEMPLATE.read_text()
    missing = set(re.findall(r"@\{(\w+)\}", text)) - values.keys()
    if missing:  # pragma: no cover - template and renderer out of sync
        raise RuntimeError(f"template placeholders without a value: {sorted(missing)}")
    return re.sub(r"@\{(\w+)\}", lambda m: values[m.group(1)], text)


def check_cluster(args: argparse.Namespace, plan: JobPlan) -> None:
    """Raise :class:`SubmitError` listing every reason the partition cannot run the plan."""
    try:
        part = partition_info(args.partition)
    except ClusterError as err:
        raise SubmitError(str(err)) from None
    problems = check_plan_fits(plan, part)
    if problems:
        raise SubmitError("the job cannot run on this cluster:\n" + "\n".join(f"  {p}" for p in problems))


def prepare(args: argparse.Namespace) -> tuple[str, Config, JobPlan, Path]:
    """Every submit-time check, then the rendered script: (script, config, plan, run directory)."""
    if args.job_name is None:
        args.job_name = Path(args.config).stem
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", args.job_name):
        raise SubmitError(
            f"--job-name {args.job_name!r}: use letters, digits and . _ + - only (it names a directory)"
        )
    run_dir = (Path(args.output_dir) / args.job_name).resolve()
    cfg = resolve_config(args, run_dir)
    plan = plan_job(
        cfg,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        ranks_per_node=args.ranks_per_node,
        server_nodes=args.server_nodes,
        servers_per_node=args.servers_per_node,
        cpus_per_task=args.cpus_per_task,
        servers_in_job=args.servers_in_job,
    )
    if args.time:
        secs = _time_to_secs(args.time)
        if secs is not None and secs <= args.signal_secs:
            raise SubmitError(
                f"--time {args.time} ({secs} s) leaves no run time before the checkpoint signal "
                f"--signal-secs {args.signal_secs}; raise --time or lower --signal-secs"
            )
    if not args.skip_cluster_checks:
        check_cluster(args, plan)
    script = render(args, cfg, plan, run_dir, run_dir / "submitted-config.yaml")
    return script, cfg, plan, run_dir


def submit(script: str, cfg: Config, run_dir: Path) -> str:
    """Write the frozen config and the script under ``run_dir`` and ``sbatch`` it; returns the job id."""
    (run_dir / "logs").mkdir(mode=0o700, parents=True, exist_ok=True)  # sbatch --output needs it to exist
    for d in (run_dir, run_dir / "logs"):  # the job's alone, also when an earlier submit made them
        os.chmod(d, 0o700)
    (run_dir / "submitted-config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    path = run_dir / "job.sbatch"
    path.write_text(script)
    for f in (path, run_dir / "submitted-config.yaml"):
        os.chmod(f, 0o600)
    try:
        proc = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SubmitError("sbatch not found: submit from a SLURM login node") from None
    except subprocess.TimeoutExpired:
        raise SubmitError(
            "sbatch did not answer within 60 s (is slurmctld up?); the job may or may not be queued"
        ) from None
    if proc.returncode != 0:
        raise SubmitError(f"sbatch rejected the job: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.strip().split(";")[0]


def main(argv: list[str] | None = None) -> int:
    # What this writes is the job owner's alone; sbatch hands the umask on to the job (SLURM_UMASK).
    os.umask(0o077)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    args.argv = raw
    try:
        script, cfg, plan, run_dir = prepare(args)
        if args.dry_run:
            print(script)
            return 0
        job_id = submit(script, cfg, run_dir)
    except (ConfigError, SubmitError) as err:
        print(f"error: {err}\nnothing was submitted.", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    print(
        f"submitted job {job_id}: {plan.trainer_nodes} trainer node(s) x {plan.ranks_per_node} ranks, "
        f"{plan.num_servers} server(s) ({plan.server_mode})\n"
        f"  log:         {run_dir}/logs/job-{job_id}.out\n"
        f"  checkpoints: {cfg.training.checkpoint_dir}\n"
        f"  status:      {run_dir}/status"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
