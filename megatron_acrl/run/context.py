"""Everything a run holds, and how it is built: the policy (and critic), the servers, the task, the logger.

:func:`setup_run` builds a :class:`RunContext` on every rank: it initialises the trainer world
(:mod:`megatron_acrl.world.distributed`), builds the tiny local model when no ``model.hf_path`` is given,
runs the supervised warm-start if asked, loads the weights into the Megatron policy (and the PPO
critic), checks that a rollout batch splits evenly over the layout, and on rank 0 opens the prompt
stream and starts the rollout servers (:class:`megatron_acrl.servers.handle.RolloutServers`); every
rank gets the run's weight publisher (:class:`megatron_acrl.servers.publisher.WeightPublisher`), the
one way the policy's weights reach the servers. The run directory is 0700; the servers' key lives in
:class:`RolloutServers` (rank 0) and nowhere else.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import yaml

from megatron_acrl.config import Config, ConfigError, config_to_dict
from megatron_acrl.logging import RunLogger
from megatron_acrl.servers.publisher import WeightPublisher
from megatron_acrl.tasks import Prompt, Task, make_task
from megatron_acrl.world.distributed import broadcast_object, init_distributed, log0

if TYPE_CHECKING:
    from megatron_acrl.megatron.critic import Critic
    from megatron_acrl.megatron.policy import Policy
    from megatron_acrl.servers.handle import RolloutServers


@dataclass
class RunContext:
    """Handles of one run (see module doc). ``servers`` and ``logger`` exist on rank 0 only."""

    cfg: Config
    args: argparse.Namespace
    rank: int
    world: int
    run_dir: Path
    model_dir: Path
    tokenizer: Any
    task: Task
    policy: Policy
    critic: Critic | None = None
    """The PPO value model (``algorithm.name == "ppo"`` only)."""
    servers: RolloutServers | None = None
    """Rank 0, unless the run replays recorded rollouts."""
    logger: RunLogger | None = None
    """Rank 0, from :meth:`start_logging` on."""
    publisher: WeightPublisher | None = None
    """The one way the policy's weights reach the servers (every rank; :func:`attach_publisher`)."""
    prompt_stream: Iterator[Prompt] | None = None
    """Rank 0: the training prompts, positioned after the prompts consumed so far."""
    last_checkpoint_step: int = -1
    """The step of the last checkpoint written or resumed from (-1: none)."""
    stopping: Callable[[], bool] = lambda: False
    """Whether this rank was asked to stop (the entry point's signals): rank 0 asks it before it
    retries a failed rollout or weight sync of the loop
    (:class:`~megatron_acrl.world.vote.StoppedWithoutServers`)."""

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.eos_id)

    # -- logging -----------------------------------------------------------------------------------

    def start_logging(self, config: dict, state: Any) -> None:
        """Rank 0: open the run's logger, continuing the W&B run of ``state`` (a resumed run) and
        superseding what an earlier attempt logged after ``state.step`` (:mod:`megatron_acrl.logging`)."""
        if self.rank != 0:
            return
        self.logger = RunLogger(
            self.cfg.logging, self.run_dir, config=config, resume_id=state.wandb_id, resume_step=state.step
        )
        state.wandb_id = self.logger.run_id

    def close(self) -> None:
        """Close the logger, the publisher and stop the servers (rank 0); safe to call twice."""
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        if self.servers is not None:
            self.servers.close()
            self.servers = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


def run_directory(cfg: Config, args: argparse.Namespace) -> Path:
    """``--run-dir``, else ``runs/<logging.run_name>`` (or a name made of the task, method and seed)."""
    if args.run_dir:
        return Path(args.run_dir)
    name = cfg.logging.run_name or f"{cfg.task.name}-{cfg.correction.method}-s{cfg.training.seed}"
    return Path("runs") / name


def resolve_checkpoint_dir(cfg: Config, args: argparse.Namespace) -> Config:
    """``cfg`` with a relative ``training.checkpoint_dir`` made absolute under the run directory (not
    the working directory): two runs started from one directory with different ``--run-dir`` never
    share (or resume) each other's checkpoints. An absolute one is kept; idempotent."""
    ckpt = cfg.training.checkpoint_dir
    if not ckpt or Path(ckpt).is_absolute():
        return cfg
    resolved = (run_directory(cfg, args) / ckpt).absolute()
    return replace(cfg, training=replace(cfg.training, checkpoint_dir=str(resolved)))


def model_directory(cfg: Config, rank: int) -> Path:
    """``model.hf_path`` or the locally built tiny checkpoint (rank 0 builds, the others wait)."""
    if cfg.model.hf_path:
        return Path(cfg.model.hf_path)
    from megatron_acrl.warmstart.tiny_model import build_checkpoint

    if rank == 0:
        build_checkpoint(cfg.model, seed=cfg.training.seed)
    dist.barrier()
    return build_checkpoint(cfg.model, seed=cfg.training.seed)


def prompt_stream(task: Task, seed: int, consumed: int = 0) -> Iterator[Prompt]:
    """The run's training prompts (``task.train_prompts(seed)``, the same order every time),
    positioned after the first ``consumed``: a resumed run and a retried rollout continue the data
    exactly where the run left it."""
    stream = task.train_prompts(seed=seed)
    if consumed:
        next(itertools.islice(stream, consumed - 1, consumed), None)
    return stream


def check_batch_layout(cfg: Config, dp_size: int) -> None:
    """A rollout batch must split into minibatches of whole micro-batches on every data-parallel rank."""
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    t = cfg.training
    if t.max_tokens_per_microbatch is not None and t.logprob_token_budget is not None:
        # Token-budget micro-batches cut whole sequences per rank (never with virtual pipelining:
        # the config refuses it).
        mbs, what = 1, ""
    else:
        mbs, what = t.micro_batch_size, f" x training.micro_batch_size({t.micro_batch_size})"
    unit = dp_size * mbs * cfg.algorithm.num_minibatches
    if per_step % unit:
        raise ConfigError(
            [
                (
                    "rollout.prompts_per_step",
                    f"prompts_per_step x n_samples_per_prompt = {per_step} "
                    f"must be a multiple of dp({dp_size}){what} x algorithm.num_minibatches"
                    f"({cfg.algorithm.num_minibatches}) = {unit}",
                )
            ]
        )


def load_models(cfg: Config, model_dir: Path) -> tuple[Policy, Critic | None]:
    """The Megatron policy and, for PPO, its critic (a value model on the same layout, initialised
    from the policy's weights), both loaded from ``model_dir``."""
    from megatron_acrl.megatron.policy import Policy

    policy = Policy(cfg)
    policy.load_hf(model_dir)
    critic = None
    if cfg.algorithm.spec.needs_critic:
        from megatron_acrl.megatron.critic import Critic

        critic = Critic(cfg)
        critic.load_hf(model_dir)
    return policy, critic


def setup_run(
    cfg: Config, args: argparse.Namespace, stopping: Callable[[], bool] = lambda: False
) -> RunContext:
    """Build the run on every rank (see module doc); ``stopping``: :attr:`RunContext.stopping`."""
    from transformers import AutoTokenizer

    cfg = resolve_checkpoint_dir(cfg, args)  # a relative one lives in the run directory
    rank, world = init_distributed(cfg)
    run_dir = run_directory(cfg, args)
    if rank == 0 and not args.load_rollouts:
        from megatron_acrl.servers.handle import check_ports

        check_ports(cfg)  # another process's server on our port: refuse now, before any model is built
    if rank == 0:
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(run_dir, 0o700)  # logs, metrics, W&B files: the run's owner's alone (also if it existed)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    model_dir = model_directory(cfg, rank)
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.model.tokenizer_path or model_dir))
    task = make_task(cfg.task)
    # Refused before the warm start (minutes), not after it: data parallelism is what the trainer's
    # ranks leave over tensor x pipeline parallelism (the Policy's own dp group, checked again below).
    check_batch_layout(cfg, max(1, world // (cfg.parallel.tp * cfg.parallel.pp)))
    if cfg.training.sft_steps > 0:
        from megatron_acrl.warmstart.sft import sft_warmstart
        from megatron_acrl.warmstart.tiny_model import default_cache_dir

        # Tiny local models share one cache (every arm of a study reuses the warm start).
        cache = default_cache_dir() / "sft" if cfg.model.hf_path is None else run_dir / "sft"
        model_dir = sft_warmstart(cfg, model_dir, cache, tokenizer, log=log0)
    policy, critic = load_models(cfg, Path(model_dir))
    check_batch_layout(cfg, policy.dp_size)
    ctx = RunContext(
        cfg=cfg,
        args=args,
        rank=rank,
        world=world,
        run_dir=run_dir,
        model_dir=Path(model_dir),
        tokenizer=tokenizer,
        task=task,
        policy=policy,
        critic=critic,
        stopping=stopping,
    )
    source = policy.sync_source
    single_node = on_one_node(world)
    if rank == 0:
        ctx.prompt_stream = prompt_stream(task, cfg.training.seed)
        if not args.load_rollouts:
            from megatron_acrl.servers.handle import RolloutServers

            log0(
                f"starting {cfg.rollout.num_servers if not cfg.rollout.server_urls else 'external'} "
                f"SGLang server(s) for {model_dir}"
            )
            label = source.label if source is not None else ""
            ctx.servers = RolloutServers(
                cfg, model_dir, run_dir / "logs", source_label=label, single_node=single_node
            )
    attach_publisher(ctx, single_node)
    dist.barrier()
    return ctx


def on_one_node(world: int) -> bool:
    """Whether every rank of the trainer world runs on this host (a collective)."""
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    return len(set(hosts)) == 1


def attach_publisher(ctx: RunContext, single_node: bool) -> WeightPublisher:
    """Give the run its weight publisher (a collective). Per-source weight sync: every rank that
    sends weights itself, but rank 0 (whose servers' synchronizer coordinates them), first joins
    rank 0's control store with its own weight source."""
    servers = ctx.servers
    control = broadcast_object(servers.control.address if servers and servers.control else None)
    source, own = ctx.policy.sync_source, None
    if control is not None and ctx.rank != 0 and source is not None:
        from megatron_acrl.servers.transfer import open_weight_source, sync_address

        address = sync_address(ctx.cfg, single_node)
        own = open_weight_source(ctx.cfg, tuple(control), source.index, source.label, address)
    ctx.publisher = WeightPublisher(
        ctx.cfg, ctx.rank, ctx.policy, servers, own, stopping=ctx.stopping, log_dir=ctx.run_dir / "logs"
    )
    return ctx.publisher
