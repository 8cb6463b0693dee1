"""What the rollout servers serve: the policy's weights of ``rollout.weight_lag_steps`` (L) steps ago.

Version v is the policy after v RL steps (:mod:`megatron_acrl.batch.staleness`). After step t's update the
trainer holds version t + 1 and :meth:`ServedWeights.publish` makes the servers serve version
``max(0, t + 1 - L)``: with L = 0 the policy's weights as they are (every rank walks the HF stream,
rank 0 sends; :meth:`~megatron_acrl.run.context.RunContext.push_weights`); with L > 0 rank 0 keeps host
copies of the versions from the served one up to the trainer's (at most L + 1 sets of HF-named
tensors, in the dtype the stream yields: (L + 1) x the model's bf16 size on rank 0's host) and pushes
the lagged set from them. A study dials the drift exactly this way, in sync or async mode.

Resume reproduces the lagged weights exactly: the sets are part of the checkpoint
(``served_weights.pt`` in the step directory, with ``served_weights.json`` naming their versions,
which :func:`check_resumable` reads before anything starts). A checkpoint that keeps fewer versions
than the configured lag needs (written with a smaller L) is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_acrl.batch.staleness import format_version
from megatron_acrl.config import Config, ConfigError

WEIGHTS_FILE = "served_weights.pt"
INDEX_FILE = "served_weights.json"

NamedTensors = list[tuple[str, Tensor]]


def served_version(trainer_version: int, lag: int) -> int:
    """The version the servers serve while the trainer holds ``trainer_version``."""
    return max(0, trainer_version - lag)


def saved_versions(step_dir: Path, step: int) -> list[int]:
    """The weight versions a checkpoint of ``step`` can serve from: its stored sets, or (none stored,
    a run without lag) the policy's own weights, version ``step``."""
    index = step_dir / INDEX_FILE
    if not index.is_file():
        return [step]
    return [int(v) for v in json.loads(index.read_text())["versions"]]


def check_resumable(cfg: Config, step_dir: Path, step: int) -> None:
    """Refuse, before anything starts, a lag the checkpoint of ``step`` cannot reproduce."""
    lag = cfg.rollout.weight_lag_steps
    need = served_version(step, lag)
    have = saved_versions(step_dir, step)
    if need not in have:
        raise ConfigError(
            [
                (
                    "rollout.weight_lag_steps",
                    f"a lag of {lag} serves version {need} at step {step}, but the checkpoint "
                    f"{step_dir} keeps only versions {have} (it was written with a smaller lag); resume with "
                    f"weight_lag_steps <= {step - min(have)} or start a fresh run (another checkpoint_dir)",
                )
            ]
        )


class ServedWeights:
    """The lag buffer and the pushes that keep the servers at ``trainer version - L`` (module doc).
    Every rank holds one and calls every method (the stream walks are collectives); the weight
    sets live on rank 0 only."""

    def __init__(self, ctx: Any, lag: int):
        self.ctx = ctx
        self.lag = lag
        self.version = 0
        """The version the servers serve."""
        self.sets: dict[int, NamedTensors] = {}
        """Rank 0, lag > 0: version -> its HF-named weights, from the served version on."""

    # -- pushes ------------------------------------------------------------------------------------

    def start(self, trainer_version: int, step_dir: Path | None = None) -> dict[str, float]:
        """Serve the run's first weights: the initial policy, or what the checkpoint in
        ``step_dir`` served (its stored sets, when it kept any)."""
        self.version = served_version(trainer_version, self.lag)
        if self.lag:
            # Decided alike on every rank (the capture is collective): the step directory is shared.
            stored = step_dir is not None and (step_dir / WEIGHTS_FILE).exists()
            if stored and self.ctx.rank == 0:
                saved = torch.load(step_dir / WEIGHTS_FILE, weights_only=True)
                self.sets = {int(v): list(ws.items()) for v, ws in saved.items() if int(v) >= self.version}
            if not stored:
                self._capture(trainer_version)  # the policy as resumed (or initial)
        return self.restore()

    def publish(self, trainer_version: int) -> dict[str, float]:
        """After an update to ``trainer_version``: serve ``max(0, trainer_version - L)``. A push that
        fails after a stop was asked raises :class:`~megatron_acrl.run.context.StoppedWithoutServers`;
        :attr:`version` and the sets are already what a checkpoint should hold (a resume pushes them)."""
        if not self.lag:
            self.version = trainer_version
            return self.ctx.push_weights(format_version(trainer_version), stoppable=True)
        self._capture(trainer_version)
        target = served_version(trainer_version, self.lag)
        metrics: dict[str, float] = {}
        if target != self.version:
            self.version = target
            metrics = self.restore(stoppable=True)
        self.sets = {v: s for v, s in self.sets.items() if v >= self.version}
        return metrics

    def restore(self, stoppable: bool = False) -> dict[str, float]:
        """Push the served version again (after a server restart or an evaluation of other weights)."""
        label = format_version(self.version)
        if not self.lag:  # the policy is the served version
            return self.ctx.push_weights(label, stoppable=stoppable)
        return self.ctx.push_weights(label, weights=self.sets.get(self.version, []), stoppable=stoppable)

    def _capture(self, version: int) -> None:
        """Every rank walks the policy's HF stream; rank 0 keeps a copy as ``version``."""
        stream = self.ctx.policy.hf_weights(all_stages=True)
        if self.ctx.rank == 0:
            self.sets[version] = [(name, t.detach().clone()) for name, t in stream]
        else:
            for _ in stream:  # the gathers inside are collectives every rank must join
                pass

    # -- checkpoint ----------------------------------------------------------------------------------

    def write(self, step_dir: Path) -> None:
        """Rank 0: store the sets a resume needs into a checkpoint's (temporary) step directory."""
        if self.ctx.rank != 0 or not self.lag:
            return
        versions = sorted(self.sets)
        torch.save({str(v): dict(self.sets[v]) for v in versions}, step_dir / WEIGHTS_FILE)
        (step_dir / INDEX_FILE).write_text(json.dumps({"lag": self.lag, "versions": versions}))

    @property
    def held_bytes(self) -> int:
        """Host memory of the stored sets (rank 0)."""
        return sum(t.numel() * t.element_size() for s in self.sets.values() for _, t in s)
