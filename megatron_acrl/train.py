"""The RL driver: ``python -m megatron_acrl.train --config configs/X.yaml [section.key=value ...]``.

Run it under ``torchrun`` (or ``srun``) for several trainer ranks; rank 0 drives the loop and owns the
rollout servers, every rank trains. One step::

    batch (generate -> reward) -> prepare (pi_old log-probs, advantages, controller) -> train -> publish

The batch comes from the rollout producer (:mod:`megatron_acrl.rollout.producer`): generated now
(``rollout.mode: sync``) or taken from the queue the servers keep filling while the trainer trains
(``async``, within ``rollout.max_staleness`` weight versions). Each phase is a named function in
its own module; this file only wires them together, and is the entry point that owns SIGTERM /
SIGINT (:mod:`megatron_acrl.world.signals`): the first finishes the step, checkpoints and stops (exit 0:
the launch script requeues the job), a second stops at once; either way the servers this process
started are stopped. Servers that fail after the first (SLURM's preemption signals their step too)
are not restarted: a failed rollout ends the loop at the last completed step, a failed weight sync
ends the step without them, and the run checkpoints that boundary and stops the same way.
"""

from __future__ import annotations

# The entry point, before Megatron is imported: in every rank torchrun starts (__main__) and in every
# child a rank spawns (__mp_main__: multiprocessing's spawn re-runs this module, e.g. the checkpoint
# writer's helper); an import of this module filters nothing.
if __name__ in ("__main__", "__mp_main__"):
    from megatron_acrl.world.backends import quiet_absent_backends

    quiet_absent_backends()  # Megatron's "Transformer Engine / Apex not installed" at its import

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from megatron_acrl.batch.rollout_batch import RolloutBatch, minibatches
from megatron_acrl.batch.staleness import staleness_metrics, turn_metrics
from megatron_acrl.batch.train_batch import TrainBatch
from megatron_acrl.config import Config, ConfigError, config_to_dict, load_config
from megatron_acrl.config.exit_codes import CONFIG_ERROR, SERVERS_UNAVAILABLE
from megatron_acrl.logging import thread_clock
from megatron_acrl.megatron.checkpoint import CheckpointSpaceError
from megatron_acrl.rollout.evaluate import eval_due
from megatron_acrl.rollout.producer import Producer, make_producer
from megatron_acrl.run.context import RunContext, setup_run
from megatron_acrl.run.preflight import preflight, resolve_checkpoint_dir
from megatron_acrl.run.resume import DriverState, check_resume, checkpoint_due, export_hf, load_driver_state
from megatron_acrl.world.backends import backends_line
from megatron_acrl.world.distributed import any_rank, log0, rank0_refusal, share_refusal
from megatron_acrl.world.signals import Interrupted, StopSignals, stop_on_signals
from megatron_acrl.world.vote import StoppedWithoutServers
from sglang_bridge.server import ServersNotReady


def train(ctx: RunContext, state: DriverState, producer: Producer, stop: StopSignals) -> DriverState:
    """The loop: one screen, each phase a named function; ``stop`` ends it after the step."""
    cfg, policy, log = ctx.cfg, ctx.policy, ctx.logger
    if state.step == 0:  # the exact metric (and an agent run's eval) of the weights that sample step 1
        m0 = producer.evaluate_exact(0) | (producer.evaluate(0) if eval_due(cfg, 0) else {})
        if m0 and log is not None:
            log.log(0, m0)
    for step in range(state.step, cfg.training.num_steps):
        t0 = time.perf_counter()
        try:
            batch, m = producer.next_batch(state, step)  # sync: generate now; async: a finished batch
        except StoppedWithoutServers as stopped:  # asked to stop, then the servers went: run() checkpoints
            log0(str(stopped))
            break
        t1, c1 = time.perf_counter(), thread_clock()
        # pi_old, reference, R2 routing, PPO values, advantages, the ACRL controller; checked once
        tb, prep_m = policy.prepare(batch.tensors(), trainer_version=step, critic=ctx.critic)
        m.update(prep_m)
        t2 = time.perf_counter()
        for mb in minibatches(tb, cfg, seed=cfg.training.seed + step):  # PPO epochs x minibatches
            m.update(policy.train_step(mb))
            if ctx.critic is not None:
                m.update(ctx.critic.train_step(mb))  # critic/* metrics
        t3, c3 = time.perf_counter(), thread_clock()
        state.weight_version = step + 1
        m.update(producer.publish(state.weight_version))  # the servers: version max(0, v - lag)
        t4 = time.perf_counter()
        state.step = step + 1
        m.update(phase_metrics(tb, (t0, t1, t2, t3, t4), (c1, c3)) | producer.step_metrics(t4 - t0, t1 - t0))
        if eval_due(cfg, state.step):
            m.update(producer.evaluate(state.step))
        m.update(producer.evaluate_exact(state.step))  # training.exact_eval_interval
        if log is not None:
            m.update(drift_metrics(tb, trainer_version=step))  # staleness, mismatch by lag
            log.log(state.step, m, **log_extras(cfg, batch, tb, state.step))
        stopping = any_rank(stop.requested)  # a stop signal on any rank: every rank stops here
        if stopping or checkpoint_due(ctx, state.step):
            producer.save_checkpoint(state)
        if stopping:
            break
    return state


def phase_metrics(
    tb: TrainBatch, t: tuple[float, ...], c: tuple[tuple[float, float], ...] = ()
) -> dict[str, float]:
    """``time/*`` of the step's phases (``t``: the clock at its five boundaries) and its token rate;
    with ``c`` (:func:`~megatron_acrl.logging.thread_clock` at the start and end of pi_old + train),
    the trainer thread's CPU seconds over those phases and its seconds waiting for a core
    (``time/train_cpu``, ``time/train_runq``: what a wall time longer than the CPU time was spent on)."""
    extra = {}
    if len(c) == 2:
        extra = {"time/train_cpu": c[1][0] - c[0][0], "time/train_runq": c[1][1] - c[0][1]}
    return extra | {
        "time/rollout": t[1] - t[0],
        "time/logprob": t[2] - t[1],
        "time/train": t[3] - t[2],
        "time/sync": t[4] - t[3],
        "time/step": t[4] - t[0],
        "perf/tokens_per_s": float(tb["loss_mask"].sum()) / max(t[4] - t[0], 1e-9),
    }


def drift_metrics(tb: TrainBatch, trainer_version: int) -> dict[str, float]:
    """``async/*`` staleness and the mismatch split by lag, from the batch's per-token versions
    (none in recordings made before them), and by agent turn (``mismatch_turn/<k>/*``) when the
    batch holds more than one turn."""
    m: dict[str, float] = {}
    if "token_versions" in tb:
        m = staleness_metrics(
            tb["token_versions"], tb["loss_mask"], tb["old_logprobs"], tb["rollout_logprobs"], trainer_version
        )
    turns = tb.get("turn_ids")
    if turns is not None and int(turns.max()) > 0:  # single-turn batches: turn 0 alone, nothing to split
        m.update(turn_metrics(turns, tb["loss_mask"], tb["old_logprobs"], tb["rollout_logprobs"]))
    return m


def log_extras(cfg: Config, batch: RolloutBatch, tb: TrainBatch, step: int) -> dict[str, Any]:
    """What a step logs besides its scalars: the histogram of per-token log(pi_old / mu) and, every
    ``logging.sample_table_interval`` steps, a table of sample completions."""
    mask = tb["loss_mask"] > 0
    out: dict[str, Any] = {
        "histograms": {"mismatch/log_ratio_hist": (tb["old_logprobs"] - tb["rollout_logprobs"])[mask].numpy()}
    }
    n = cfg.logging.sample_table_interval
    if n and step % n == 0 and batch.prompts:
        rows = [
            [batch.prompts[i], batch.completions[i], float(batch.rewards[i])]
            for i in range(min(8, len(batch)))
        ]
        out["table"] = (["prompt", "completion", "reward"], rows)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m megatron_acrl.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="YAML file in configs/")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. correction.gamma=0.8")
    ap.add_argument(
        "--run-dir", default=None, help="where logs, W&B files and plots go (default runs/<name>)"
    )
    ap.add_argument("--save-rollouts", default=None, metavar="DIR", help="record every rollout batch")
    ap.add_argument(
        "--export-hf",
        default=None,
        metavar="DIR",
        help="at the end, write the policy as an HF safetensors model directory (with model.lora: a "
        "PEFT adapter directory, adapter_config.json + adapter_model.safetensors)",
    )
    ap.add_argument(
        "--export-hf-merged",
        default=None,
        metavar="DIR",
        help="at the end, write the policy with its LoRA adapters merged into the weights as an HF model",
    )
    ap.add_argument(
        "--load-rollouts",
        default=None,
        metavar="DIR",
        help="replay recorded rollout batches instead of generating (no SGLang server)",
    )
    return ap.parse_args(argv)


def run(
    cfg: Config, args: argparse.Namespace, prepare: Callable[[RunContext], None] | None = None
) -> DriverState:
    """Set up, resume, train, checkpoint, clean up. ``prepare`` sees the context before the first
    step (tests use it to inject faults).

    The stop handlers (see module doc) cover everything from set-up to clean-up: a SIGTERM while the
    servers start still checkpoints after the first step; leaving, however, stops every server.
    """
    # Everything the run writes (run directory, logs, checkpoints, W&B files, its servers' logs) is
    # its owner's alone, whatever the umask it was started with; the entry point owns the umask.
    os.umask(0o077)
    with stop_on_signals() as stop:
        ctx = setup_run(cfg, args, lambda: stop.requested)
        try:
            log0(backends_line(cfg, ctx.servers))  # rank 0: what the run uses, in one line
            if prepare is not None:
                prepare(ctx)
            state, step_dir = load_driver_state(ctx)
            ctx.start_logging(config_to_dict(cfg), state)
            producer = make_producer(ctx, state, step_dir)  # serves the initial (or resumed) weights
            try:
                state = train(ctx, state, producer, stop)
                if ctx.cfg.training.checkpoint_dir and ctx.last_checkpoint_step != state.step:
                    producer.save_checkpoint(state)
                if ctx.cfg.training.checkpoint_dir and ctx.last_checkpoint_step == state.step:
                    stop.checkpointed_step = state.step  # a signal from here on loses nothing
            finally:
                producer.close()
            if args.export_hf:
                export_hf(ctx, args.export_hf)
            if getattr(args, "export_hf_merged", None):
                export_hf(ctx, args.export_hf_merged, merged=True)
            if ctx.rank == 0:
                ended = f"finished at step {state.step}"
                if stop.requested:  # a stop is not the end of the run: say so, and whether it resumes
                    saved = " (checkpointed)" if ctx.last_checkpoint_step == state.step else ""
                    ended = f"stopped at step {state.step}{saved}"
                print(f"run {ended}; metrics: {ctx.run_dir / 'metrics.jsonl'}", flush=True)
        finally:
            ctx.close()
    return state


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = resolve_checkpoint_dir(load_config(args.config, args.overrides), args)
        cfg.check_paths()
        if args.load_rollouts and cfg.rollout.mode == "async":
            raise ConfigError([("rollout.mode", "--load-rollouts replays recorded batches: set mode sync")])
        preflight(cfg, args)  # the data, tokens, directories, servers' needs: before anything starts
        check_resume(cfg)  # a checkpoint this config cannot continue exactly
    except ConfigError as err:
        print(err, file=sys.stderr)
        return CONFIG_ERROR
    try:
        run(cfg, args)
    except ConfigError as err:  # layout checks that need the launched world (dp, batch divisibility)
        print(err, file=sys.stderr)
        return share_refusal(CONFIG_ERROR)  # rank 0 alone (producer_cpus): the others exit alike
    except ServersNotReady as err:
        print(err, file=sys.stderr)
        return share_refusal(SERVERS_UNAVAILABLE)  # rank 0 alone starts the servers
    except CheckpointSpaceError as err:  # refused before writing: the checkpoints so far are intact
        print(f"checkpoint not written: {err}", file=sys.stderr)
        return 1
    except Interrupted as err:  # a second stop signal
        if err.checkpointed_step is not None:  # during the clean-up of a checkpointed stop
            print(f"{err} during clean-up; step {err.checkpointed_step} is checkpointed", file=sys.stderr)
            return 0
        print(f"{err}: stopped without a checkpoint of the current step", file=sys.stderr)
        return err.exit_code
    except Exception:
        code = rank0_refusal()  # this rank's collective broke because rank 0 refused and left
        if code is None:
            raise
        return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
