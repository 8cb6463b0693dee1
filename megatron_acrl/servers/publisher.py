"""The weight publisher: the one way the policy's weights reach the rollout servers.

:class:`WeightPublisher` (``start / publish / restore / close``, every rank holds one and calls
every method: the stream walks are collectives) owns what the servers serve, the lag buffer, the
retries of a failed push with the servers' recovery, and the stop rule:

* **What is served.** Version v is the policy after v RL steps
  (:mod:`megatron_acrl.batch.staleness`). After step t's update the trainer holds version t + 1 and
  :meth:`WeightPublisher.publish` makes the servers serve ``max(0, t + 1 - L)``,
  L = ``rollout.weight_lag_steps``.
* **One push** (:meth:`WeightPublisher.push`). Per source (``rollout.weight_sync: per_source``) each
  pipeline stage's and EP rank's source sends its own part while rank 0 runs the update's
  lifecycle; with ``rank0`` every stage is broadcast to rank 0, which sends it all. A failed push
  restarts dead servers, kills and replaces hung ones (a timeout), or reconnects the synchronizer (a
  failed source) (:mod:`megatron_acrl.servers.recovery`), and tries again, twice; rank 0 decides
  for every rank (:func:`megatron_acrl.world.vote.vote`).
* **The stop rule.** A push of the loop that fails after a stop was asked is not recovered: the
  servers are going down with the job (SLURM's preemption), so :meth:`~WeightPublisher.publish`
  ends the step without them (``sync/stopped`` = 1, :attr:`~WeightPublisher.servers_gone`) and the
  loop checkpoints it; the resume pushes the served version to the new servers.
* **Adapters only** (``model.lora.sync: adapter``). A push gathers the policy's LoRA adapters to
  rank 0 (``policy.adapter_state()``, a collective every rank joins: PEFT-named full tensors on
  rank 0) and loads them on every server under the version's name
  (:meth:`~megatron_acrl.servers.handle.RolloutServers.update_adapter`,
  :mod:`megatron_acrl.servers.lora_sync`); the base weights the servers loaded stay. Retries,
  recovery and the stop rule are the same; a restarted server gets the current adapter at the retry.
  The lag buffer then holds adapter sets (a few MB each instead of the model).
* **The lag buffer.** With L = 0 the policy's weights are sent as they are; with L > 0 rank 0 keeps
  host copies of the versions from the served one up to the trainer's (at most L + 1 sets of
  HF-named tensors, in the dtype the stream yields: (L + 1) x the model's bf16 size on rank 0's
  host) and pushes the lagged set from them. A study dials the drift exactly this way, in sync or
  async mode.

Resume reproduces the lagged weights exactly: the sets are part of the checkpoint
(``served_weights.pt`` in the step directory, with ``served_weights.json`` naming their versions,
which :func:`check_resumable` reads before anything starts). A checkpoint that keeps fewer versions
than the configured lag needs (written with a smaller L) is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_acrl.batch.staleness import format_version
from megatron_acrl.config import Config, ConfigError
from megatron_acrl.servers.lora_sync import adapter_mode
from megatron_acrl.servers.transfer import push_from_source, recovery
from megatron_acrl.world.distributed import log0
from megatron_acrl.world.vote import ERROR, OK, RETRY, STOPPED, StoppedWithoutServers, Verdict, vote
from sglang_bridge.weight_sync import WeightSource

WEIGHTS_FILE = "served_weights.pt"
INDEX_FILE = "served_weights.json"

NamedTensors = list[tuple[str, Tensor]]

PUSH_ATTEMPTS = 3
"""Tries of one push (a recovery between two)."""


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


class WeightPublisher:
    """Pushes the policy's weights to the servers (module doc). ``servers`` (rank 0's handle,
    :class:`~megatron_acrl.servers.handle.RolloutServers`) and ``source`` (a non-zero rank's own
    weight source under per-source sync) are None where a rank has none; ``stopping`` says whether
    this rank was asked to stop (rank 0's is the one that counts)."""

    def __init__(
        self,
        cfg: Config,
        rank: int,
        policy: Any,
        servers: Any = None,
        source: WeightSource | None = None,
        *,
        stopping: Callable[[], bool] = lambda: False,
        log_dir: Path | None = None,
    ):
        self.cfg, self.rank, self.policy = cfg, rank, policy
        self.servers, self.source = servers, source
        self.stopping = stopping
        self.log_dir = log_dir
        self.lag = cfg.rollout.weight_lag_steps
        self.adapters = adapter_mode(cfg)
        """Push the LoRA adapters only (``model.lora.sync: adapter``), else the full weights."""
        self.version = 0
        """The version the servers serve."""
        self.sets: dict[int, NamedTensors] = {}
        """Rank 0, lag > 0: version -> its HF-named weights, from the served version on."""
        self.servers_gone = False
        """A publish failed after a stop was asked: the step ends without the servers (no eval)."""

    # -- the lifecycle --------------------------------------------------------------------------------

    def start(self, trainer_version: int, step_dir: Path | None = None) -> dict[str, float]:
        """Serve the run's first weights: the initial policy, or what the checkpoint in
        ``step_dir`` served (its stored sets, when it kept any)."""
        self.version = served_version(trainer_version, self.lag)
        if self.lag:
            # Decided alike on every rank (the capture is collective): the step directory is shared.
            stored = step_dir is not None and (step_dir / WEIGHTS_FILE).exists()
            if stored and self.rank == 0:
                saved = torch.load(step_dir / WEIGHTS_FILE, weights_only=True)
                self.sets = {int(v): list(ws.items()) for v, ws in saved.items() if int(v) >= self.version}
            if not stored:
                self._capture(trainer_version)  # the policy as resumed (or initial)
        return self.restore()

    def publish(self, trainer_version: int) -> dict[str, float]:
        """After an update to ``trainer_version``: serve ``max(0, trainer_version - L)``. A push that
        fails after a stop was asked ends the step without the servers (the stop rule, module doc):
        ``{"sync/stopped": 1.0}``; :attr:`version` and the sets are already what a checkpoint should
        hold."""
        try:
            return self._publish(trainer_version)
        except StoppedWithoutServers as err:
            log0(str(err))
            self.servers_gone = True
            return {"sync/stopped": 1.0}

    def restore(self, stoppable: bool = False) -> dict[str, float]:
        """Push the served version again (after a server restart or an evaluation of other weights)."""
        label = format_version(self.version)
        if not self.lag:  # the policy is the served version
            return self.push(label, stoppable=stoppable)
        return self.push(label, weights=self.sets.get(self.version, []), stoppable=stoppable)

    def close(self) -> None:
        """Drop the lag buffer and leave the update group of this rank's own source; safe twice.
        (The servers belong to the run context, which stops them.)"""
        self.sets = {}
        if self.source is not None:
            self.source.close()
            self.source = None

    # -- one push, retried -----------------------------------------------------------------------------

    def push(
        self,
        label: str,
        *,
        quantize: bool = True,
        weights: Sequence[tuple[str, Tensor]] | None = None,
        stoppable: bool = False,
    ) -> dict[str, float]:
        """Push the policy's weights as version ``label`` (module doc); ``quantize=False`` pushes them
        without the rollout's FP8 quantization (bf16 servers only). ``weights``: rank 0's stored
        HF-named weights to push instead (the lag buffer); then no rank walks the stream, rank 0
        sends the whole set (the config allows a lag only with one source), and every rank passes a
        value (the others' is ignored). ``stoppable`` (the loop's pushes): a push that fails after a
        stop was asked raises :class:`StoppedWithoutServers` on every rank instead of a recovery."""
        where = f"; see the server logs in {self.log_dir}" if self.log_dir else ""
        return vote(
            lambda attempt: self._push_once(label, quantize, weights, stoppable),
            attempts=PUSH_ATTEMPTS,
            recover=lambda attempt, why: self._recover(label, attempt, why),
            failed=lambda why, exhausted: (
                f"weight sync to {label} failed {PUSH_ATTEMPTS} times{where}: {why[0]}"
                if exhausted
                else f"weight sync to {label} failed: {why}"
            ),
            stopped=lambda why: (
                f"weight sync to {label} failed after a stop was asked ({why}); the servers are going "
                "down with the job: not recovered, the step ends without them"
            ),
        )

    def _push_once(
        self, label: str, quantize: bool, weights: Sequence[tuple[str, Tensor]] | None, stoppable: bool
    ) -> Verdict:
        """One try on this rank; rank 0's verdict (:mod:`megatron_acrl.world.vote`) is ``(OK,
        metrics)``, ``(RETRY, (error, recovery))``, ``(ERROR, error)`` or ``(STOPPED, error)``."""
        if self.adapters:
            return self._push_adapter_once(label, weights, stoppable)
        per_source = self.cfg.rollout.weight_sync == "per_source"
        if weights is not None:  # the lag buffer: rank 0 holds the whole set and sends it
            stream, meta = iter(weights), None
        else:
            stream = (
                self.policy.hf_source_weights() if per_source else self.policy.hf_weights(all_stages=True)
            )
            meta = self.policy.hf_source_meta() if per_source else None
        metrics: dict[str, float] = {}
        err, action = "", None
        try:
            if self.servers is not None:
                if stoppable and self.stopping() and (dead := self.servers.dead_servers()):
                    # not the restart update_weights would start: the servers go down with the job
                    raise RuntimeError(f"server(s) {dead} gone")
                metrics = self.servers.update_weights(stream, label, quantize=quantize, meta=meta)
            elif self.source is not None and meta is not None:
                push_from_source(self.cfg, self.source, stream, meta, quantize=quantize)
        except Exception as e:  # noqa: BLE001 - reported to all ranks, then retried or raised
            err = f"{type(e).__name__}: {e}"
            action = recovery(e, bool(self.servers.dead_servers())) if self.servers is not None else None
        try:
            for _ in stream:  # drain: the gathers inside are collectives every rank must join
                pass
        except Exception as e:  # noqa: BLE001 - a stream that fails here still reaches the vote
            err = err or f"{type(e).__name__}: {e}"
        return self._verdict(err, action, metrics, stoppable)

    def _push_adapter_once(
        self, label: str, weights: Sequence[tuple[str, Tensor]] | None, stoppable: bool
    ) -> Verdict:
        """One adapter push on this rank (module doc): every rank joins the gather, rank 0 loads."""
        metrics: dict[str, float] = {}
        err, action = "", None
        try:
            adapter = dict(weights) if weights is not None else self._adapter_state()
            if self.servers is not None:
                if stoppable and self.stopping() and (dead := self.servers.dead_servers()):
                    raise RuntimeError(f"server(s) {dead} gone")
                metrics = self.servers.update_adapter(adapter, label)
        except Exception as e:  # noqa: BLE001 - reported to all ranks, then retried or raised
            err = f"{type(e).__name__}: {e}"
            action = recovery(e, bool(self.servers.dead_servers())) if self.servers is not None else None
        return self._verdict(err, action, metrics, stoppable)

    def _adapter_state(self) -> dict[str, Tensor]:
        """Every rank (a collective): the policy's adapters, PEFT-named full tensors on rank 0 (the
        other ranks' are ignored: empty or None)."""
        return dict(self.policy.adapter_state() or {})

    def _verdict(self, err: str, action: str | None, metrics: dict[str, float], stoppable: bool) -> Verdict:
        if not err:
            if self.servers is not None:
                metrics["sync/restarts"] = float(self.servers.restarts)
                metrics["sync/hung_restarts"] = float(self.servers.hung_restarts)
            return OK, metrics
        if stoppable and self.stopping():
            return STOPPED, err
        return (RETRY, (err, action)) if action is not None else (ERROR, err)

    def _recover(self, label: str, attempt: int, why: tuple[str, str]) -> None:
        """Every rank, after a failed try: rank 0 does what the failure called for."""
        err, action = why
        tries = f"attempt {attempt + 1}/{PUSH_ATTEMPTS}"
        log0(f"weight sync to {label} failed ({tries}): {err}; {action} and retry")
        if self.servers is None:
            return
        try:
            self.servers.recover(action, attempt)
        except Exception as e:  # noqa: BLE001 - the next attempt's vote keeps the ranks in step
            log0(f"{action} failed: {type(e).__name__}: {e}")

    # -- the lag buffer ----------------------------------------------------------------------------------

    def _publish(self, trainer_version: int) -> dict[str, float]:
        if not self.lag:
            self.version = trainer_version
            return self.push(format_version(trainer_version), stoppable=True)
        self._capture(trainer_version)
        target = served_version(trainer_version, self.lag)
        metrics: dict[str, float] = {}
        if target != self.version:
            self.version = target
            metrics = self.restore(stoppable=True)
        self.sets = {v: s for v, s in self.sets.items() if v >= self.version}
        return metrics

    def _capture(self, version: int) -> None:
        """Every rank walks the policy's HF stream (its adapters, under adapter sync); rank 0 keeps a
        copy as ``version``."""
        if self.adapters:
            adapter = self._adapter_state()
            if self.rank == 0:
                self.sets[version] = [(name, t.detach().clone()) for name, t in adapter.items()]
            return
        stream = self.policy.hf_weights(all_stages=True)
        if self.rank == 0:
            self.sets[version] = [(name, t.detach().clone()) for name, t in stream]
        else:
            for _ in stream:  # the gathers inside are collectives every rank must join
                pass

    # -- checkpoint ----------------------------------------------------------------------------------

    def write(self, step_dir: Path) -> None:
        """Rank 0: store the sets a resume needs into a checkpoint's (temporary) step directory."""
        if self.rank != 0 or not self.lag:
            return
        versions = sorted(self.sets)
        torch.save({str(v): dict(self.sets[v]) for v in versions}, step_dir / WEIGHTS_FILE)
        (step_dir / INDEX_FILE).write_text(json.dumps({"lag": self.lag, "versions": versions}))

    @property
    def held_bytes(self) -> int:
        """Host memory of the stored sets (rank 0)."""
        return sum(t.numel() * t.element_size() for s in self.sets.values() for _, t in s)
