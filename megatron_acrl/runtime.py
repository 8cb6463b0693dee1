"""Everything a run holds: process groups, the trainer, the rollout engine, the task, the logger.

:func:`setup_run` builds a :class:`RunContext` on every rank: it initialises torch.distributed
(gloo on CPU, NCCL on GPU) and Megatron's parallel layout, builds the tiny local model when no
``model.hf_path`` is given, runs the supervised warm-start if asked, loads the weights into the
Megatron trainer, and on rank 0 starts the rollout engine (SGLang servers + weight sync).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_acrl.config import Config, ConfigError, config_to_dict
from megatron_acrl.tasks import Prompt, Task, make_task


def log0(*msg: object) -> None:
    """Print on the driver rank only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*msg, file=sys.stderr, flush=True)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from ``src`` on every rank of the world (pickled)."""
    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def init_distributed(cfg: Config) -> tuple[int, int]:
    """Initialise the default group from torchrun/srun variables (or a 1-rank world) and Megatron."""
    from megatron_acrl.megatron.trainer import initialize_parallel

    if not dist.is_initialized():
        env = os.environ
        if "RANK" not in env and "SLURM_PROCID" in env:  # srun without torchrun
            env.setdefault("RANK", env["SLURM_PROCID"])
            env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
            env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
        env.setdefault("RANK", "0")
        env.setdefault("WORLD_SIZE", "1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env:
            from sglang_bridge.server import free_port

            env["MASTER_PORT"] = str(free_port())
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    world = dist.get_world_size()
    p = cfg.parallel
    if p.world_size is not None and p.world_size != world:
        raise ConfigError(
            [("parallel.world_size", f"config says {p.world_size} but {world} ranks were launched")]
        )
    p.data_parallel_size(world)  # raises a ConfigError naming the layout if inconsistent
    initialize_parallel(p, cfg.training.seed)
    return dist.get_rank(), world


@dataclass
class RunContext:
    """Handles of one run (see module doc). ``engine`` and ``logger`` exist on rank 0 only."""

    cfg: Config
    args: argparse.Namespace
    rank: int
    world: int
    run_dir: Path
    model_dir: Path
    tokenizer: Any
    task: Task
    trainer: Any
    critic: Any = None  # megatron_acrl.megatron.critic.Critic when algorithm.name == "ppo"
    engine: Any = None
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

    def sync_weights(self, version: str, *, quantize: bool = True) -> dict[str, float]:
        """Push the trainer's weights to the rollout engine (all ranks walk the gathered stream);
        ``quantize=False`` pushes them without the rollout's FP8 quantization (bf16 servers only).

        A failed sync (a server died) restarts the engine's servers and tries again, twice.
        """
        for attempt in range(3):
            stream = self.trainer.hf_weights(all_stages=True)
            metrics: dict[str, float] = {}
            ok, retry, err = True, False, ""
            if self.engine is not None:
                try:
                    metrics = self.engine.sync_weights(stream, version, quantize=quantize)
                except Exception as e:  # noqa: BLE001 - reported to all ranks, then retried or raised
                    from sglang_bridge.client import ServerGoneError

                    ok, err = False, f"{type(e).__name__}: {e}"
                    retry = isinstance(e, ServerGoneError) or bool(self.engine.dead_servers())
            for _ in stream:  # drain: the gathers inside are collectives every rank must join
                pass
            ok, retry, err = broadcast_object((ok, retry, err))
            if not ok and not retry:
                raise RuntimeError(f"weight sync to {version} failed: {err}")
            if ok:
                if self.engine is not None:
                    metrics["sync/restarts"] = float(self.engine.restarts)
                return metrics
            log0(f"weight sync to {version} failed (attempt {attempt + 1}/3): {err}; restarting the servers")
            if self.engine is not None:
                self.engine.restart()
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
        if self.engine is not None:
            self.engine.close()
            self.engine = None


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

    from megatron_acrl.megatron.trainer import Trainer

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
    trainer = Trainer(cfg)
    trainer.load_hf(model_dir)
    critic = None
    if cfg.algorithm.name == "ppo":  # value model on the same layout, initialised from the policy
        from megatron_acrl.megatron.critic import Critic

        critic = Critic(cfg)
        critic.load_hf(model_dir)
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    unit = trainer.dp_size * cfg.training.micro_batch_size * cfg.algorithm.num_minibatches
    if per_step % unit:
        raise ConfigError(
            [
                (
                    "rollout.prompts_per_step",
                    f"prompts_per_step x n_samples_per_prompt = {per_step} "
                    f"must be a multiple of dp({trainer.dp_size}) x training.micro_batch_size"
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
        trainer=trainer,
        critic=critic,
    )
    if rank == 0:
        ctx.prompt_stream = task.train_prompts(seed=cfg.training.seed)
        if not args.load_rollouts:
            from megatron_acrl.engine import RolloutEngine

            log0(
                f"starting {cfg.rollout.num_servers if not cfg.rollout.server_urls else 'external'} "
                f"SGLang server(s) for {model_dir}"
            )
            ctx.engine = RolloutEngine(cfg, model_dir, run_dir / "logs")
    dist.barrier()
    return ctx


def skip_prompts(ctx: RunContext, n: int) -> None:
    """Advance the prompt stream by ``n`` (resume at the recorded data position)."""
    if ctx.prompt_stream is not None and n:
        next(itertools.islice(ctx.prompt_stream, n - 1, n), None)
