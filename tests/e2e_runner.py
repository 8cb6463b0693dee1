"""Runs several driver runs in one process (start-up, not compute, dominates on CPU).

    python tests/e2e_runner.py SPEC.json

SPEC is a list of runs: ``{"config": path, "overrides": [...], "args": [...], "faults": {...}}``.
Faults (injected through ``megatron_acrl.train.run``'s ``prepare`` hook, tests only):
``kill_server_at_step: k`` kills the SGLang server right before step k's generation;
``nan_logprob_at_step: k`` turns one rollout log-prob of step k into NaN, as a faulty engine would;
``sigterm_at_train_step: k`` sends this process SIGTERM during the k-th optimizer step (preemption);
``sigterm_and_kill_server_at_step: k`` sends it SIGTERM and kills the server right before step k's
generation (SLURM's preemption signals the servers' step with the trainer's);
``sigterm_and_kill_server_at_train_step: k`` does the same during the k-th optimizer step, before
the step's weight sync.
Each run's final driver state is appended to ``<run_dir>/state.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys

from megatron.core import parallel_state

import megatron_acrl.rollout.evaluate as evaluate_mod
from megatron_acrl.config import load_config
from megatron_acrl.train import parse_args, run


def inject(faults: dict):
    def prepare(ctx):
        if "sigterm_at_train_step" in faults:
            train_step, count = ctx.policy.train_step, {"n": 0}

            def preempted(batch):
                out = train_step(batch)
                count["n"] += 1
                if count["n"] == faults["sigterm_at_train_step"]:
                    os.kill(os.getpid(), signal.SIGTERM)  # what SLURM sends on preemption
                return out

            ctx.policy.train_step = preempted
        if "sigterm_and_kill_server_at_train_step" in faults:
            train_step2, count2 = ctx.policy.train_step, {"n": 0}

            def preempted_with_servers(batch):
                out = train_step2(batch)
                count2["n"] += 1
                if count2["n"] == faults["sigterm_and_kill_server_at_train_step"] and ctx.servers:
                    os.kill(os.getpid(), signal.SIGTERM)
                    ctx.servers.servers[0].kill()
                return out

            ctx.policy.train_step = preempted_with_servers
        servers = ctx.servers
        if servers is None or not faults:
            return
        generate = servers.generate
        calls = {"n": 0}
        evaluating = {"on": False}
        served_eval = evaluate_mod._evaluate_served

        def marked_eval(ctx, prefix):  # eval generations (greedy and sampled) are not training's
            evaluating["on"] = True
            try:
                return served_eval(ctx, prefix)
            finally:
                evaluating["on"] = False

        evaluate_mod._evaluate_served = marked_eval

        def faulty(prompt_ids, n, params):
            # Training generations happen once per step here (no dynamic sampling).
            training = not evaluating["on"]
            step = calls["n"] if training else -1  # counts successful training generations only
            if step == faults.get("kill_server_at_step") and not calls.get("killed"):
                calls["killed"] = True
                servers.servers[0].kill()
            if step == faults.get("sigterm_and_kill_server_at_step") and not calls.get("killed"):
                calls["killed"] = True
                os.kill(os.getpid(), signal.SIGTERM)
                servers.servers[0].kill()
            groups = generate(prompt_ids, n, params)
            if training:
                calls["n"] += 1
            if step == faults.get("nan_logprob_at_step"):
                groups[0][0].rollout_logprobs[0] = float("nan")
            return groups

        servers.generate = faulty

    return prepare


def main(prepare_for=None, key: str = "faults") -> None:
    """Run every item of the JSON spec at ``argv[1]`` in this process, each prepared by
    ``prepare_for(item[key])`` (this runner's fault injection by default), and write its state."""
    spec = json.loads(open(sys.argv[1]).read())
    for item in spec:
        cfg = load_config(item["config"], item.get("overrides", []))
        args = parse_args(["--config", item["config"], *item.get("args", [])])
        state = run(cfg, args, prepare=(prepare_for or inject)(item.get(key, {})))
        with open(f"{args.run_dir}/state.json", "w") as f:
            json.dump(dataclasses.asdict(state), f)
        parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main()
