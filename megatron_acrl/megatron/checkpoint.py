"""Megatron distributed checkpoints and the atomic commit of a training step.

Two halves:

* One model's distributed checkpoint (``torch_dist`` backend of ``megatron.core.dist_checkpointing``,
  reshardable over TP / PP / VPP / EP / DP): the sharded-state metadata, :func:`save_dist` /
  :func:`load_dist` (fully parallel over the DP x CP group), the compatibility check that refuses
  another model's checkpoint before any tensor is read (:func:`checkpoint_meta`,
  :func:`check_compatible`), and :func:`load_chunks`.
* The step directory and its commit: :func:`save_step_atomically` writes every part of a step
  (policy, critic, driver) into ``.tmp-step_<n>/``, fsyncs, renames and replaces ``latest.json``;
  :func:`resolve_step_dir` finds the committed step.

What goes *into* a model's sharded state dict (chunks, optimizer, schedule, controller) is the
model's own (``base.ModelTrainer.sharded_state_dict`` and its subclasses).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)

from megatron_acrl.config import Config, ConfigError
from megatron_acrl.megatron.model import unwrap
from megatron_acrl.megatron.step_manifest import (
    needs_manifest,
    read_latest,
    step_bytes,
    step_dirs,
    step_name,
    verify_step,
    write_manifest,
)

__all__ = [
    "CHECKPOINT_BACKEND",
    "CheckpointSpaceError",
    "remove_partial_saves",
    "space_problem",
    "check_compatible",
    "checkpoint_meta",
    "load_chunks",
    "load_common_state",
    "load_dist",
    "resolve_step_dir",
    "save_dist",
    "save_step_atomically",
    "sharded_metadata",
]

CHECKPOINT_BACKEND = "torch_dist"

log = logging.getLogger(__name__)

_CHECKPOINT_MODEL_FIELDS = (
    "family",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "qk_layernorm",
    "add_qkv_bias",
    "tie_embeddings",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_ffn_hidden_size",
    "params_dtype",
)
"""Model fields that fix a checkpointed tensor's global shape or dtype (or its presence)."""


# --------------------------------------------------------------------------------------------
# One model's distributed checkpoint
# --------------------------------------------------------------------------------------------


def sharded_metadata(dp_cp_group: dist.ProcessGroup) -> dict[str, Any]:
    """Metadata steering ``sharded_state_dict`` of the model and the optimizer."""
    return {
        # The distributed optimizer's state in the canonical per-parameter layout (gathered over DP
        # on save, sliced on load), so it reshards over TP, PP, EP and DP like the weights.
        # 'dp_reshardable' would be fully parallel but tied to this TP x PP layout.
        "distrib_optim_sharding_type": "fully_reshardable",
        "chained_optim_avoid_prefix": True,
        "singleton_local_shards": False,
        "dp_cp_group": dp_cp_group,
    }


def checkpoint_meta(
    cfg: Config, kind: str, optimizer: Any, dp_size: int, lora: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What a checkpoint must agree on to be loadable: the tensors' global shapes and dtypes
    (model fields), the optimizer format and the model kind; the layout is informational.

    ``lora``: a LoRA model's adapters (``rank``, ``alpha``, ``target_modules``) and the frozen
    base they were trained on (``base``: ``path`` and ``sha256``, ``lora.base_reference``); the
    checkpoint then holds the adapters and their optimizer state only."""
    m, p = cfg.model, cfg.parallel
    return {
        "kind": kind,
        "lora": dict(lora) if lora is not None else None,
        "model": {k: getattr(m, k) for k in _CHECKPOINT_MODEL_FIELDS},
        "distributed_optimizer": p.distributed_optimizer,
        # Megatron chains a second optimizer for expert-parallel parameters; the optimizer's
        # common state is one entry per chained optimizer, so the count must not change.
        "optimizers": len(getattr(optimizer, "chained_optimizers", [optimizer])),
        "layout": {
            "tp": p.tp,
            "pp": p.pp,
            "vpp": p.vpp,
            "ep": p.ep,
            "dp": dp_size,
            "distributed_optimizer": p.distributed_optimizer,
            "world": dist.get_world_size(),
        },
    }


def save_dist(state: dict[str, Any], path: str | os.PathLike, dp_cp_group: dist.ProcessGroup) -> None:
    """Write a sharded state dict as a distributed checkpoint into ``path`` (all ranks call it).

    ``torch_dist`` backend (``torch.distributed.checkpoint`` files, fsynced); replicated shards
    are spread over the DP ranks (fully parallel save), each shard is written once.
    """
    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(CHECKPOINT_BACKEND), dp_cp_group
    )
    dist_checkpointing.save(state, str(path), strategy)


def load_dist(
    state: dict[str, Any], path: str | os.PathLike, dp_cp_group: dist.ProcessGroup
) -> dict[str, Any]:
    """Read the distributed checkpoint ``path`` into the (``is_loading``) sharded state dict
    ``state``, under any TP/PP/VPP/EP/DP layout; returns the loaded state dict."""
    strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(path)), dp_cp_group)
    return dist_checkpointing.load(state, str(path), strategy)


def load_common_state(path: str | os.PathLike) -> dict[str, Any]:
    """The common (rank 0, non-sharded) state of the distributed checkpoint ``path``."""
    return dist_checkpointing.load_common_state_dict(str(path))


def load_chunks(
    model: list[torch.nn.Module],
    loaded: Mapping[str, Any],
    path: str | os.PathLike,
    only: Callable[[str], bool] | None = None,
) -> None:
    """Copy ``loaded["chunk<i>"]`` into each model chunk; RuntimeError on missing/unexpected keys.
    ``only``: the parameter names the checkpoint holds (LoRA: the adapters); others stay as they are."""
    for i, chunk in enumerate(model):
        missing, unexpected = unwrap(chunk).load_state_dict(loaded[f"chunk{i}"], strict=False)
        # Only Megatron's (empty, local-spec) ``_extra_state`` entries may be absent.
        missing = [k for k in missing if not k.endswith("_extra_state") and (only is None or only(k))]
        if missing or unexpected:
            raise RuntimeError(f"{path}: chunk {i} missing {missing[:5]}, unexpected {unexpected[:5]}")


_FRESH_HINT = (
    "set it to the checkpoint's value to resume, or point training.checkpoint_dir at a new "
    "directory to start fresh"
)


def check_compatible(path: str | os.PathLike, mine: Mapping[str, Any]) -> None:
    """Refuse a checkpoint that another model wrote, before any tensor is read.

    ``mine`` is this run's :func:`checkpoint_meta`. Raises FileNotFoundError when ``path`` is no
    distributed checkpoint, ConfigError naming every mismatched field (model, optimizer format,
    chained optimizers, model kind) with the values on both sides and the fix.
    """
    path = Path(path)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(
            f"{path} is not a distributed checkpoint (no metadata.json): the step directory is "
            f"incomplete or has no {mine['kind']} state (a PPO critic needs a checkpoint of a PPO run)"
        )
    saved = load_common_state(path).get("acrl_meta")
    if saved is None:
        raise ConfigError([("training.checkpoint_dir", f"{path} was not written by megatron-acrl")])
    errors = [
        (f"model.{k}", f"checkpoint {path} has {saved['model'].get(k)!r}, this run {v!r}; {_FRESH_HINT}")
        for k, v in mine["model"].items()
        if saved["model"].get(k) != v
    ]
    if saved["distributed_optimizer"] != mine["distributed_optimizer"]:
        errors.append(
            (
                "parallel.distributed_optimizer",
                f"checkpoint {path} has {saved['distributed_optimizer']}, this run "
                f"{mine['distributed_optimizer']} (optimizer state formats differ); {_FRESH_HINT}",
            )
        )
    if saved.get("optimizers", mine["optimizers"]) != mine["optimizers"]:
        errors.append(
            (
                "parallel.ep",
                f"checkpoint {path} was written with {saved['optimizers']} chained optimizer(s) "
                f"(layout {saved['layout']}), this run has {mine['optimizers']}: Megatron gives "
                "expert parameters their own optimizer only under expert parallelism, so EP=1 and "
                "EP>1 checkpoints do not exchange optimizer state; keep parallel.ep on the same side "
                "of 1, or export the weights (--export-hf) and start from them with model.hf_path",
            )
        )
    errors += _lora_errors(path, saved.get("lora"), mine.get("lora"))
    if saved["kind"] != mine["kind"]:
        errors.append(("", f"{path} holds a {saved['kind']} model, not a {mine['kind']}"))
    if errors:
        raise ConfigError(errors)


def _lora_errors(path: Path, saved: Mapping[str, Any] | None, mine: Mapping[str, Any] | None) -> list:
    """A LoRA checkpoint resumes only with the same adapters on the same base (its tensors are the
    adapters alone: on another base, or as a full model, they would mean something else)."""
    if saved is None and mine is None:
        return []
    if saved is None or mine is None:
        had = "LoRA adapters (no base weights)" if saved else "full weights"
        want = "model.lora set" if mine else "model.lora null"
        return [("model.lora", f"checkpoint {path} holds {had}, this run has {want}; {_FRESH_HINT}")]
    errors = [
        (f"model.lora.{k}", f"checkpoint {path} has {saved.get(k)!r}, this run {mine[k]!r}; {_FRESH_HINT}")
        for k in ("rank", "alpha", "target_modules")
        if saved.get(k) != mine[k]
    ]
    old, new = saved.get("base") or {}, mine.get("base") or {}
    if old.get("sha256") != new.get("sha256"):
        errors.append(
            (
                "model.hf_path",
                f"checkpoint {path} holds adapters trained on the base {old.get('path')!r} (fingerprint "
                f"{old.get('sha256')}), this run loads {new.get('path')!r} (fingerprint "
                f"{new.get('sha256')}): "
                "adapters fit only their own base; set model.hf_path to the checkpoint's base, or start "
                "fresh in a new training.checkpoint_dir",
            )
        )
    return errors


# --------------------------------------------------------------------------------------------
# The step directory and its atomic commit
# --------------------------------------------------------------------------------------------


_step_name = step_name

SPACE_MARGIN = 1.1
"""Free space a save needs, as a multiple of the previous checkpoint's size (files grow a little:
optimizer step counts, a longer driver state)."""


class CheckpointSpaceError(OSError):
    """Too little free space for a checkpoint (raised on every rank, before anything is written)."""


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root``): what rank 0 wrote (common
    state, metadata, the driver's file) is otherwise only in the page cache; the ``.distcp`` shards
    were fsynced by their writers already, a second fsync costs nothing. On the way every file is
    made 0600 and every directory 0700, whichever rank wrote it and whatever its umask was: a
    checkpoint holds the run's weights and is its owner's alone."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fchmod(fd, 0o600)
                os.fsync(fd)
            finally:
                os.close(fd)
        os.chmod(dirpath, 0o700)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_latest(root: Path, step: int, name: str) -> None:
    latest = root / "latest.json"
    if isinstance(read_latest(root), str):  # a damaged one is kept beside, not overwritten
        kept = _aside(root, "latest.json.damaged")
        os.rename(latest, kept)
        log.warning("%s was unreadable; kept as %s", latest, kept)
    tmp = root / f".latest.json.tmp-{os.getpid()}"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(json.dumps({"step": step, "dir": name, "manifest": True}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, latest)
    _fsync_dir(root)


def _commit(root: Path, tmp: Path, final: Path, step: int) -> None:
    """Rank 0: fsync ``tmp``, rename it to ``final`` (moving a previous ``final`` aside until the
    rename is done), then replace ``latest.json``: the commit point."""
    _fsync_tree(tmp)
    write_manifest(tmp)
    _fsync_dir(tmp)
    trash = None
    problem = verify_step(final, need_manifest=needs_manifest(root)) if final.exists() else None
    if problem is not None:
        # A damaged checkpoint of this step (the run resumed from an older one): kept, never deleted.
        kept = _aside(root, f"damaged-{final.name}")
        os.rename(final, kept)
        log.warning("%s is damaged (%s); kept as %s", final, problem, kept)
    if final.exists():  # saved before (uncommitted, or committed and now superseded)
        trash = root / f".trash-{final.name}"
        if trash.exists():
            shutil.rmtree(trash)
        os.rename(final, trash)  # resolve_step_dir falls back to it until the next rename
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_latest(root, step, final.name)
    if trash is not None:
        shutil.rmtree(trash)


def _aside(root: Path, name: str) -> Path:
    """A free name ``root/name`` (or ``name-<k>``) to keep a damaged file or directory under."""
    path, k = root / name, 1
    while path.exists():
        path, k = root / f"{name}-{k}", k + 1
    return path


def space_problem(root: Path, step: int) -> str | None:
    """Rank 0, before a save: why ``root`` cannot hold another checkpoint (None: it can). The need is
    estimated from the newest existing step (nothing to go by before the first save)."""
    previous = next((p for _, p in step_dirs(root)), None) if root.is_dir() else None
    if previous is None:
        return None
    need = int(step_bytes(previous) * SPACE_MARGIN)
    free = shutil.disk_usage(root).free
    if free >= need:
        return None
    return (
        f"not enough free space for the next checkpoint ({_step_name(step)}) in {root}: about "
        f"{human_size(need)} needed (the size of {previous.name} x {SPACE_MARGIN}), {human_size(free)} "
        f"free. Free at least {human_size(need - free)} on that disk (older step_* directories there "
        "you do not need, other files), or point training.checkpoint_dir at a larger disk; the "
        "checkpoints already written are intact and the run resumes from the newest"
    )


def human_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (``1.6 MiB``, ``512 B``):
    a checkpoint of a tiny model is megabytes, of a real one hundreds of gigabytes."""
    size, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def remove_partial_saves(directory: str | os.PathLike) -> list[Path]:
    """Rank 0, at start: remove the ``.tmp-step_*`` directories (and temporary ``latest.json``
    files) of saves that crashed or ran out of disk: never committed, so nothing resumes from them,
    and on a full disk they hold the space the next save needs. Returns what was removed."""
    root = Path(directory)
    if not root.is_dir():
        return []
    removed = sorted([*root.glob(".tmp-step_*"), *root.glob(".latest.json.tmp-*")])
    for path in removed:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        log.warning("removed the partial save %s (never committed)", path)
    return removed


def save_step_atomically(
    directory: str | os.PathLike, step: int, writers: Sequence[Callable[[Path], None]]
) -> Path:
    """Write a checkpoint of ``step`` so that a crash at any point leaves the last good one loadable.

    Every rank calls it. The writers fill ``directory/.tmp-step_<n>/`` (each is called on every
    rank with that path); then rank 0 fsyncs the tree, renames it to ``step_<n>/`` and replaces
    ``latest.json`` (temporary file, fsync, ``os.replace``, fsync of the directory): the commit
    point. A crash before the rename leaves only a ``.tmp-`` directory (removed by the next save);
    one between the rename and ``latest.json`` leaves an uncommitted ``step_<n>/`` that
    ``latest.json`` does not name (replaced by the next save of that step). Returns ``step_<n>/``.
    """
    root = Path(directory)
    final, tmp = root / _step_name(step), root / f".tmp-{_step_name(step)}"
    rank0 = dist.get_rank() == 0
    verdict = [space_problem(root, step) if rank0 else None]
    dist.broadcast_object_list(verdict, src=0)  # every rank refuses alike, before anything is written
    if verdict[0] is not None:
        raise CheckpointSpaceError(verdict[0])
    if rank0:
        if tmp.exists():  # a crashed save of the same step
            shutil.rmtree(tmp)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)  # the run's checkpoints: its owner's alone (see _fsync_tree)
        tmp.mkdir(mode=0o700)
    dist.barrier()
    for write in writers:
        write(tmp)
    dist.barrier()  # every rank's files are complete
    if rank0:
        _commit(root, tmp, final, step)
    dist.barrier()
    return final


def resolve_step_dir(directory: str | os.PathLike, step: int | None = None) -> Path | None:
    """``directory/step_<step>`` or, with ``step=None``, the step directory ``latest.json`` names
    (None when there is no ``latest.json``: nothing was ever committed there)."""
    root = Path(directory)
    if step is None:
        latest = read_latest(root)
        if latest is None:
            return None
        if isinstance(latest, str):
            raise FileNotFoundError(f"{latest}; the driver resumes from the newest intact step instead")
        name = latest[1]
    else:
        name = _step_name(step)
    found = root / name
    if not found.exists() and (root / f".trash-{name}").exists():
        return root / f".trash-{name}"  # a crash mid-replacement of the same step (see above)
    if not found.exists():
        raise FileNotFoundError(f"{found} is missing: checkpoint {name} was removed or never committed")
    return found
