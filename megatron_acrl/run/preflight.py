"""Pre-flight: every check of a run's inputs that needs *this* machine, before any process starts.

:func:`preflight` runs in ``python -m megatron_acrl.train``'s ``main`` after the config loaded and
validated itself (which needs nothing but the YAML) and before :func:`megatron_acrl.train.run`
initialises the trainer world, builds a model or starts a server. It reads what the run will read
and probes what it will write:

* the task's data (``task.data_path``: a file of JSON objects, UTF-8, every field there, every answer
  a number) and every prompt's length in tokens against ``rollout.max_prompt_len``;
* the tokenizer against ``model.vocab_size`` (a token id past the embedding table);
* the run directory, ``training.checkpoint_dir``, ``--save-rollouts`` (a directory, or creatable,
  and writable: a file is probed into the nearest existing directory) and ``--load-rollouts``;
* the servers the driver starts: ``rollout.server_cpus`` against the host's cores (the job's cpuset),
  the key ``rollout.api_key_env`` names, and ``rollout.fp8_mode`` on the device the servers get;
* ``logging.wandb_mode: online`` against the W&B credentials.

Every problem found is reported at once, as a :class:`ConfigError` naming the key (or file:line)
and the fix; ``main`` prints it and exits 2 (:data:`megatron_acrl.config.exit_codes.CONFIG_ERROR`).
Every rank runs it (the same inputs, the same verdict), so no rank starts alone.
"""

from __future__ import annotations

import argparse
import itertools
import netrc
import os
import tempfile
from pathlib import Path
from typing import Any

from megatron_acrl.config import Config, ConfigError
from megatron_acrl.run.context import resolve_checkpoint_dir, run_directory
from megatron_acrl.tasks import Task, make_task

__all__ = [
    "check_directories",
    "check_inputs",
    "check_servers",
    "check_wandb",
    "preflight",
    "resolve_checkpoint_dir",
]

Errors = list[tuple[str, str]]

_PROMPTS_CHECKED = 4096
"""Prompts of an endless synthetic stream whose length is checked (a file-backed task: every row)."""


def preflight(cfg: Config, args: argparse.Namespace) -> None:
    """Check everything the run reads and writes on this machine (see module doc); raise a
    ConfigError listing every problem. Starts nothing; a writability probe leaves nothing behind."""
    errors: Errors = []
    errors += check_directories(cfg, args)
    errors += check_inputs(cfg)
    if not args.load_rollouts and cfg.rollout.backend == "sglang":
        errors += check_servers(cfg)
    errors += check_wandb(cfg)
    if errors:
        raise ConfigError(errors)


def check_inputs(cfg: Config) -> Errors:
    """The checks of what the run reads that need neither GPUs nor servers nor the run's directories:
    the task's data, the tokenizer against the embedding table, every prompt's length. The trainer
    runs them in :func:`preflight`; ``launch.submit`` (``--dry-run`` too) runs them before it queues
    a job that would fail on them."""
    task, errors = _load_task(cfg)
    return errors + _check_tokens(cfg, task)


# -- directories ---------------------------------------------------------------------------------


def check_directories(cfg: Config, args: argparse.Namespace) -> Errors:
    """The run directory, the checkpoint directory and ``--save-rollouts`` must be directories this
    user can write (or create); ``--load-rollouts`` must be a directory."""
    errors: Errors = []
    targets = [("--run-dir", run_directory(cfg, args))]
    if cfg.training.checkpoint_dir:
        targets.append(("training.checkpoint_dir", Path(cfg.training.checkpoint_dir)))
    if args.save_rollouts:
        targets.append(("--save-rollouts", Path(args.save_rollouts)))
    for key, path in targets:
        msg = writable_directory_problem(path)
        if msg:
            errors.append((key, msg))
    if args.load_rollouts and not Path(args.load_rollouts).is_dir():
        errors.append(
            (
                "--load-rollouts",
                f"{args.load_rollouts} is no directory of recorded rollouts (--save-rollouts)",
            )
        )
    return errors


def writable_directory_problem(path: Path) -> str | None:
    """Why the run cannot write into directory ``path`` (None: it can). A missing one is judged by its
    nearest existing ancestor, which must be a directory where a file can be made (probed, as
    ``os.access`` says yes to root on a read-only mount)."""
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a directory; choose another path (or move the file away)"
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{path} cannot be created: {probe} is a file, not a directory; choose another path"
    try:
        fd, name = tempfile.mkstemp(prefix=".acrl-write-probe-", dir=probe)
    except OSError as err:
        where = "" if probe == path else f" (its nearest existing parent, where {path} would be made)"
        return (
            f"{probe}{where} is not writable ({err.strerror}); choose a directory this user can write, "
            "or fix its permissions"
        )
    os.close(fd)
    os.unlink(name)
    return None


# -- task data and tokens --------------------------------------------------------------------------


def _load_task(cfg: Config) -> tuple[Task | None, Errors]:
    """The task, read now (a data file's error names file:line); None and the error when it fails."""
    try:
        return make_task(cfg.task), []
    except (ValueError, OSError) as err:  # the loaders' messages name the file and line
        return None, [("task.data_path" if cfg.task.data_path else "task.name", str(err))]


def load_tokenizer(cfg: Config) -> tuple[Any, str]:
    """The tokenizer the run will use and where it comes from: ``model.tokenizer_path``, else the HF
    checkpoint's, else the tiny local one (built into the same cache the tiny model uses)."""
    from transformers import AutoTokenizer

    path = cfg.model.tokenizer_path or cfg.model.hf_path
    if path is None:
        from megatron_acrl.warmstart.tiny_model import build_tokenizer, tiny_tokenizer_vocab

        path = str(build_tokenizer(tiny_tokenizer_vocab(cfg.model)))  # the one the checkpoint carries
    return AutoTokenizer.from_pretrained(str(path)), str(path)


def _check_tokens(cfg: Config, task: Task | None) -> Errors:
    """The tokenizer fits the embedding table, and every prompt fits ``rollout.max_prompt_len``."""
    try:
        tok, where = load_tokenizer(cfg)
    except ValueError as err:  # the tiny tokenizer: bytes + special tokens do not fit the vocab
        if cfg.model.tokenizer_path or cfg.model.hf_path:  # a directory without a usable tokenizer
            key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.hf_path"
            return [(key, f"no tokenizer could be loaded: {err}")]
        return [
            ("model.vocab_size", f"the tiny local tokenizer cannot be built: {err}; raise model.vocab_size")
        ]
    except OSError as err:
        return [("model.tokenizer_path", f"no tokenizer could be loaded: {err}")]
    errors: Errors = []
    if len(tok) > cfg.model.vocab_size:
        errors.append(
            (
                "model.vocab_size",
                f"{cfg.model.vocab_size} is smaller than the tokenizer's {len(tok)} tokens ({where}): "
                f"ids past the embedding table would index out of range; set model.vocab_size >= {len(tok)}",
            )
        )
    if task is not None:
        errors += _check_prompt_lengths(cfg, task, tok)
    return errors


def _check_prompt_lengths(cfg: Config, task: Task, tok: Any) -> Errors:
    """Every training and evaluation prompt (a file: every row; a synthetic stream: its first
    :data:`_PROMPTS_CHECKED`) is at most ``rollout.max_prompt_len`` tokens (never truncated)."""
    limit = cfg.rollout.max_prompt_len
    n = getattr(task, "num_train_prompts", _PROMPTS_CHECKED)
    prompts = list(itertools.islice(task.train_prompts(seed=cfg.training.seed), n))
    prompts += task.eval_prompts(cfg.task.eval_size)
    ids = tok([p.text for p in prompts], add_special_tokens=False)["input_ids"] if prompts else []
    long = sorted({(p.uid, len(x)) for p, x in zip(prompts, ids, strict=True) if len(x) > limit})
    if not long:
        return []
    where = f"{cfg.task.data_path}:" if cfg.task.data_path else f"task {cfg.task.name} prompt "
    shown = ", ".join(f"{where}{uid} ({k} tokens)" for uid, k in long[:5])
    more = f" and {len(long) - 5} more" if len(long) > 5 else ""
    longest = max(k for _, k in long)
    return [
        (
            "rollout.max_prompt_len",
            f"{len(long)} prompt(s) are longer than max_prompt_len={limit} tokens (prompts are never "
            f"truncated): {shown}{more}; raise rollout.max_prompt_len to >= {longest} (with "
            "model.max_position_embeddings) or shorten the data",
        )
    ]


# -- servers and W&B ------------------------------------------------------------------------------


def check_servers(cfg: Config) -> Errors:
    """What the servers the driver starts (or is given) need here: their cores, their key, FP8 on
    their device."""
    from megatron_acrl.servers.handle import run_api_key
    from megatron_acrl.servers.transfer import check_fp8_mode, resolve_device, resolve_fp8_mode
    from sglang_bridge.server_spec import host_cores

    errors: Errors = []
    r = cfg.rollout
    if r.server_cpus:
        allowed = host_cores()
        absent = [c for c in r.server_cpus if c not in allowed]
        if absent:
            errors.append(
                (
                    "rollout.server_cpus",
                    f"names core(s) {absent} this machine (or this job's cpuset) does not have (it "
                    f"has {sorted(allowed)}); choose cores from those, or [] to share every core",
                )
            )
    for check in (
        lambda: run_api_key(cfg),
        lambda: check_fp8_mode(cfg, resolve_fp8_mode(cfg, resolve_device(cfg))),
    ):
        try:
            check()
        except ConfigError as err:
            errors += err.errors
    return errors


def check_wandb(cfg: Config) -> Errors:
    """``logging.wandb_mode: online`` needs credentials here: ``WANDB_API_KEY`` or a ``wandb login``
    entry in ``~/.netrc`` for the W&B host (else ``wandb.init`` fails or prompts after the servers
    started)."""
    if cfg.logging.wandb_mode != "online" or os.environ.get("WANDB_API_KEY"):
        return []
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://", 1)[-1].split("/")[0]
    try:
        if netrc.netrc().authenticators(host.split(":")[0]):
            return []
    except (OSError, netrc.NetrcParseError):
        pass
    return [
        (
            "logging.wandb_mode",
            f"online needs W&B credentials for {host}: export WANDB_API_KEY (or run `wandb login`), or "
            "set logging.wandb_mode=offline (and `wandb sync` the run directory later)",
        )
    ]
