"""Everything a run holds: the policy (and critic), the rollout servers, the task, the logger.

:func:`setup_run` builds a :class:`RunContext` on every rank: it initialises the trainer world
(:mod:`megatron_acrl.distributed`), builds the tiny local model when no
``model.hf_path`` is given, runs the supervised warm-start if asked, loads the weights into the
Megatron trainer, and on rank 0 starts the rollout servers (SGLang + weight sync).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_acrl.config import Config, ConfigError, config_to_dict
from megatron_acrl.distributed import broadcast_object, init_distributed, log0
from megatron_acrl.tasks import Prompt, Task, make_task
from sglang_bridge.client import ServerGoneError


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
    policy: Any
    critic: Any = None  # megatron_acrl.megatron.critic.Critic when algorithm.name == "ppo"
    servers: Any = None  # megatron_acrl.rollout_servers.RolloutServers (rank 0, unless replaying)
    logger: Any = None
    prompt_stream: Iterator[Prompt] | None = None
    last_checkpoint_step: int = -1
    _stop: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.eos_id)

    # -- weights ---------------------------------------------------------------------------------

    def push_weights(self, version: str, *, quantize: bool = True) -> dict[str, float]:
        """Push the policy's weights to the rollout servers (all ranks walk the gathered stream);
        ``quantize=False`` pushes them without the rollout's FP8 quantization (bf16 servers only).

        A failed sync (a server died) restarts the servers and tries again, twice.
        """
        for attempt in range(3):
            stream = self.policy.hf_weights(all_stages=True)
            metrics: dict[str, float] = {}
            ok, retry, err = True, False, ""
            if self.servers is not None:
                try:
                    metrics = self.servers.update_weights(stream, version, quantize=quantize)
                except Exception as e:  # noqa: BLE001 - reported to all ranks, then retried or raised
                    ok, err = False, f"{type(e).__name__}: {e}"
                    retry = isinstance(e, ServerGoneError) or bool(self.servers.dead_servers())
            for _ in stream:  # drain: the gathers inside are collectives every rank must join
                pass
            ok, retry, err = broadcast_object((ok, retry, err))
            if not ok and not retry:
                raise RuntimeError(f"weight sync to {version} failed: {err}")
            if ok:
                if self.servers is not None:
                    metrics["sync/restarts"] = float(self.servers.restarts)
                return metrics
            log0(f"weight sync to {version} failed (attempt {attempt + 1}/3): {err}; restarting the servers")
            if self.servers is not None:
                self.servers.restart()
        raise RuntimeError(f"weight sync to {version} failed 3 times; see the server logs in {self.run_dir}")

    # -- checkpoints and stopping --------------------------------------------------------------

    def should_checkpoint(self, step: int) -> bool:
        t = self.cfg.training
        return bool(t.checkpoint_dir) and t.save_interval > 0 and step % t.save_interval == 0

    def checkpointed(self, step: int) -> bool:
        return self.last_checkpoint_step == step

    def request_stop(self) -> None:
        self._stop = True

    def stop_requested(self) -> bool:
        """True on every rank if any rank got SIGTERM (one tiny all-reduce per step)."""
        flag = torch.tensor([1.0 if self._stop else 0.0])
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    # -- logging -----------------------------------------------------------------------------------

    def start_logging(self, config: dict, state: Any) -> None:
        from megatron_acrl.logging import RunLogger

        if self.rank != 0:
            return
        self.logger = RunLogger(self.cfg.logging, self.run_dir, config=config, resume_id=state.wandb_id)
        state.wandb_id = self.logger.run_id

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        if self.servers is not None:
            self.servers.close()
            self.servers = None


def _run_dir(cfg: Config, args: argparse.Namespace) -> Path:
    if args.run_dir:
        return Path(args.run_dir)
    name = cfg.logging.run_name or f"{cfg.task.name}-{cfg.correction.method}-s{cfg.training.seed}"
    return Path("runs") / name


def model_directory(cfg: Config, rank: int) -> Path:
    """``model.hf_path`` or the locally built tiny checkpoint (rank 0 builds, the others wait)."""
    if cfg.model.hf_path:
        return Path(cfg.model.hf_path)
    from megatron_acrl.tiny_model import build_checkpoint

    if rank == 0:
        build_checkpoint(cfg.model, seed=cfg.training.seed)
    dist.barrier()
    return build_checkpoint(cfg.model, seed=cfg.training.seed)


def setup_run(cfg: Config, args: argparse.Namespace) -> RunContext:
    """Build the run on every rank (see module doc)."""
    from transformers import AutoTokenizer

    from megatron_acrl.megatron.policy import Policy

    rank, world = init_distributed(cfg)
    run_dir = _run_dir(cfg, args)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(
            __import__("yaml").safe_dump(config_to_dict(cfg), sort_keys=False)
        )
    model_dir = model_directory(cfg, rank)
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.model.tokenizer_path or model_dir))
    task = make_task(cfg.task)
    if cfg.training.sft_steps > 0:
        from megatron_acrl.sft import sft_warmstart
        from megatron_acrl.tiny_model import default_cache_dir

        # Tiny local models share one cache (every arm of a study reuses the warm start).
        cache = default_cache_dir() / "sft" if cfg.model.hf_path is None else run_dir / "sft"
        model_dir = sft_warmstart(cfg, model_dir, cache, tokenizer, log=log0)
    policy = Policy(cfg)
    policy.load_hf(model_dir)
    critic = None
    if cfg.algorithm.name == "ppo":  # value model on the same layout, initialised from the policy
        from megatron_acrl.megatron.critic import Critic

        critic = Critic(cfg)
        critic.load_hf(model_dir)
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    unit = policy.dp_size * cfg.training.micro_batch_size * cfg.algorithm.num_minibatches
    if per_step % unit:
        raise ConfigError(
            [
                (
                    "rollout.prompts_per_step",
                    f"prompts_per_step x n_samples_per_prompt = {per_step} "
                    f"must be a multiple of dp({policy.dp_size}) x training.micro_batch_size"
                    f"({cfg.training.micro_batch_size}) x algorithm.num_minibatches"
                    f"({cfg.algorithm.num_minibatches}) = {unit}",
                )
            ]
        )
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
    )
    if rank == 0:
        ctx.prompt_stream = task.train_prompts(seed=cfg.training.seed)
        if not args.load_rollouts:
            from megatron_acrl.rollout_servers import RolloutServers

            log0(
                f"starting {cfg.rollout.num_servers if not cfg.rollout.server_urls else 'external'} "
                f"SGLang server(s) for {model_dir}"
            )
            ctx.servers = RolloutServers(cfg, model_dir, run_dir / "logs")
    dist.barrier()
    return ctx


def skip_prompts(ctx: RunContext, n: int) -> None:
    """Advance the prompt stream by ``n`` (resume at the recorded data position)."""
    if ctx.prompt_stream is not None and n:
        next(itertools.islice(ctx.prompt_stream, n - 1, n), None)
