"""The optimizer schedule and checkpoints, the task, and logging."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_acrl.config._base import _check, _Section


@dataclass(frozen=True)
class TrainingConfig(_Section):
    num_steps: int = 20
    """RL steps (rollout batches) to run."""

    micro_batch_size: int = 4
    """Sequences per micro-batch in the Megatron schedule."""

    lr: float = 1e-5
    """Peak learning rate (Adam)."""

    min_lr: float = 0.0
    """Final learning rate of the cosine schedule."""

    lr_warmup_steps: int = 0
    """Linear warm-up optimizer steps."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    adam_beta1: float = 0.9
    """Adam beta1."""

    adam_beta2: float = 0.999
    """Adam beta2."""

    adam_eps: float = 1e-8
    """Adam epsilon."""

    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables."""

    seed: int = 1234
    """Seed of model init, sampling and data order."""

    checkpoint_dir: str | None = None
    """Where checkpoints go; None disables checkpointing."""

    save_interval: int = 0
    """Save every N steps (and on SIGTERM); 0 saves only at the end and on SIGTERM."""

    resume: bool = True
    """Resume from the newest intact checkpoint in checkpoint_dir if one exists. false in a directory
    that holds checkpoints is refused (a fresh run would overwrite them): use a new checkpoint_dir."""

    resume_allow_changes: tuple[str, ...] = ()
    """Keys (dotted, e.g. task.data_path) a resume may change although they change the model or the
    data (model.*, task.*, training.seed, algorithm.name): a resume whose config differs from the
    checkpoint's in any other such key is refused, naming them."""

    eval_interval: int = 0
    """Evaluate on the held-out split every N steps; 0 disables."""

    eval_samples: int = 0
    """Sampled evaluation at every eval (0: off): this many samples at the rollout temperature for
    each of ``task.eval_size`` fixed training prompts, logged as ``eval/sampled_reward``: the training
    reward on a fixed prompt set, without the noise of a moving batch."""

    eval_trainer_weights: bool = False
    """With FP8 rollout served as bf16 (fake-quant, stress emulation), also run every eval on the
    trainer's own weights: push them unquantized, evaluate (``eval_trainer/*``), push the rollout's
    quantized copy back. Tells what training learned apart from what FP8 sampling loses (the
    server's KV-cache dtype still applies). Without rollout quantization ``eval_trainer/*`` repeats
    ``eval/*``. Not possible with real FP8 servers (``rollout.fp8_mode``)."""

    exact_eval_interval: int = 0
    """The exact metric every N steps (0: off), and at step 0 and the last step: J = the mean over
    every prompt of an enumerable task (1-digit addition: 100) of P(reference answer + EOS | prompt),
    teacher-forced at temperature 1, on the trainer's weights (``eval/exact_j``, a forward pass) and
    on the served copy (``eval/exact_j_served``, the servers' prompt log-probs of the same tokens, so
    FP8 weights and the FP8 KV cache count). No sampling noise: cheap enough for every 10 steps."""

    logprob_chunk_size: int | None = None
    """Tokens per chunk of the fused vocab-parallel log-prob (bounds its extra memory); None sizes
    chunks so one chunk's float32 working set stays in each core's cache on CPU (1024 on GPU)."""

    activation_recompute: Literal["none", "full"] = "none"
    """Recompute each transformer layer's activations during backward (Megatron full / uniform, one
    layer per checkpoint): less activation memory for one more forward. MoE routing replay replays
    the same experts in the recomputed forward."""

    sft_steps: int = 0
    """Supervised warm-start steps on the task's reference answers before RL (0 skips it). The
    result is cached by config, so every arm of a study starts from the same policy."""

    sft_lr: float = 1e-3
    """Learning rate of the supervised warm-start."""

    sft_batch_size: int = 32
    """Sequences per supervised warm-start step."""

    max_tokens_per_microbatch: int | None = None
    """Cut training micro-batches by a token budget instead of micro_batch_size: sequences are sorted
    by length and packed first-fit-decreasing into micro-batches whose padded size (sequences x their
    own longest length, rounded to the TP size under sequence parallelism) stays within this many
    tokens, and each data-parallel rank gets about the same number of tokens. The loss and its
    gradients do not change (global denominators). None: fixed micro_batch_size, every micro-batch
    padded to the longest sequence of the batch. Must hold the longest possible sequence
    (rollout.max_prompt_len + rollout.max_new_tokens)."""

    max_tokens_per_logprob_microbatch: int | None = None
    """The same budget for the forward-only passes (pi_old, reference log-probs, critic values), which
    keep no activations and can take more; None: max_tokens_per_microbatch (or micro_batch_size when
    that is None too)."""

    @property
    def logprob_token_budget(self) -> int | None:
        """The token budget of the forward-only passes (None: fixed micro_batch_size)."""
        if self.max_tokens_per_logprob_microbatch is not None:
            return self.max_tokens_per_logprob_microbatch
        return self.max_tokens_per_microbatch

    def validate(self) -> list[tuple[str, str]]:
        e: list[tuple[str, str]] = []
        _check(e, self.num_steps >= 0, "num_steps", "must be >= 0")
        _check(e, self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        _check(e, self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _check(e, 0 <= self.min_lr <= self.lr, "min_lr", f"must be in [0, lr={self.lr}]")
        _check(e, self.lr_warmup_steps >= 0, "lr_warmup_steps", "must be >= 0")
        _check(e, self.weight_decay >= 0, "weight_decay", "must be >= 0")
        _check(e, 0 <= self.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
        _check(e, 0 <= self.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
        _check(e, self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 disables)")
        _check(e, self.save_interval >= 0, "save_interval", "must be >= 0")
        _check(e, self.eval_interval >= 0, "eval_interval", "must be >= 0")
        _check(e, self.eval_samples >= 0, "eval_samples", "must be >= 0 (0 turns the sampled eval off)")
        _check(e, self.exact_eval_interval >= 0, "exact_eval_interval", "must be >= 0 (0 turns it off)")
        _check(
            e,
            self.logprob_chunk_size is None or self.logprob_chunk_size >= 1,
            "logprob_chunk_size",
            "must be >= 1, or null to size chunks automatically",
        )
        _check(e, self.sft_steps >= 0, "sft_steps", "must be >= 0 (0 skips the warm-start)")
        _check(e, self.sft_lr > 0, "sft_lr", "must be > 0")
        _check(e, self.sft_batch_size >= 1, "sft_batch_size", "must be >= 1")
        for name in ("max_tokens_per_microbatch", "max_tokens_per_logprob_microbatch"):
            budget = getattr(self, name)
            _check(e, budget is None or budget >= 1, name, f"must be >= 1 tokens, or null; got {budget}")
        return e


@dataclass(frozen=True)
class TaskConfig(_Section):
    name: Literal["addition", "counting", "sorting", "gsm8k"] = "addition"
    """Task with a verifiable reward: a synthetic task (addition, counting, sorting) or gsm8k (JSONL at
    data_path)."""

    data_path: str | None = None
    """JSONL file for file-backed tasks (gsm8k format: question, answer)."""

    num_digits: int = 2
    """Synthetic tasks: operand size."""

    eval_size: int = 64
    """Held-out prompts for evaluation."""

    heldout_fraction: float = 0.1
    """Synthetic tasks: the fraction of instances held out of training (split by a hash of the
    instance) for the greedy held-out accuracy. 0 trains on every instance and has no held-out split:
    right for 1-digit addition, whose 100 facts cannot be inferred from each other (a held-out fact
    is never learned), and whose every prompt the exact metric (``training.exact_eval_interval``)
    then scores as a trained one."""

    def validate(self) -> list[tuple[str, str]]:
        e: list[tuple[str, str]] = []
        _check(e, self.num_digits >= 1, "num_digits", "must be >= 1")
        _check(e, self.eval_size >= 0, "eval_size", "must be >= 0")
        _check(
            e,
            0 <= self.heldout_fraction < 1,
            "heldout_fraction",
            f"must be in [0, 1) (0: no held-out split), got {self.heldout_fraction}",
        )
        if self.name == "gsm8k":
            _check(e, self.data_path is not None, "data_path", "gsm8k needs data_path: a JSONL file")
        return e


@dataclass(frozen=True)
class LoggingConfig(_Section):
    wandb_project: str = "megatron-acrl"
    """W&B project name."""

    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode; online needs WANDB_API_KEY."""

    wandb_dir: str = "wandb"
    """Directory of the W&B run files."""

    run_name: str | None = None
    """Run name; None lets W&B choose."""

    log_interval: int = 1
    """Log every N steps."""

    sample_table_interval: int = 10
    """Log a table of sample completions every N steps; 0 disables."""

    console: bool = True
    """Show a console progress line with the key numbers."""

    def validate(self) -> list[tuple[str, str]]:
        e: list[tuple[str, str]] = []
        _check(e, self.log_interval >= 1, "log_interval", "must be >= 1")
        _check(e, self.sample_table_interval >= 0, "sample_table_interval", "must be >= 0")
        return e
