"""The RL loop end to end: real Megatron trainer, real SGLang CPU server, ACRL, W&B offline.

One live run (recording its rollouts, with a killed server and a NaN log-prob injected) feeds the
replay runs: every algorithm x every correction, resume exactness and a resume past a damaged
checkpoint, without a server.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_acrl.batch.rollout_batch import load_rollouts
from megatron_acrl.logging import read_jsonl_metrics, read_wandb_history
from megatron_acrl.megatron.step_manifest import select_step_dir

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "tiny_dense.yaml")
BASE = [
    # Warm start long enough that the policy is right about a third of the time (as in the demo):
    # recorded groups then mix rewards, so the replayed GRPO advantages (and the loss's gradient)
    # are not zero. With 30 steps nearly every sample scored 0.
    "training.sft_steps=150",
    "training.sft_lr=3e-3",
    "task.num_digits=1",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "training.micro_batch_size=8",
    "rollout.max_new_tokens=6",
    "rollout.max_prompt_len=16",
    "logging.sample_table_interval=2",
]
LIVE_STEPS = 4


def run_spec(
    tmp: Path,
    spec: list[dict],
    timeout: int = 1500,
    runner: str = "e2e_runner.py",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``spec`` (a list of runs) through ``tests/<runner>`` in ``tmp``; a failure shows the
    runner's last traceback and keeps its whole stderr beside the spec."""
    path = tmp / f"spec-{len(list(tmp.glob('spec-*')))}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", **(env or {})}
    res = subprocess.run(
        [sys.executable, str(ROOT / "tests" / runner), str(path)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if res.returncode != 0:
        log = path.with_suffix(".stderr.log")
        log.write_text(res.stderr)
        # SGLang's server-args dump alone fills a plain tail: show the last traceback first.
        at = res.stderr.rfind("Traceback (most recent call last)")
        trace = res.stderr[at : at + 6000] if at >= 0 else ""
        raise AssertionError(
            f"runner failed (rc={res.returncode}; whole stderr in {log}):\n{res.stdout[-3000:]}\n"
            f"{trace}\n--- stderr tail ---\n{res.stderr[-3000:]}"
        )
    return res


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    run_dir = tmp / "live"
    spec = [
        {
            "config": CONFIG,
            "overrides": BASE
            + [
                f"training.num_steps={LIVE_STEPS}",
                "training.eval_interval=2",
                "training.eval_samples=2",
                "training.eval_trainer_weights=true",
                f"training.checkpoint_dir={tmp / 'live-ckpt'}",
                "training.save_interval=2",
            ],
            "args": [
                "--run-dir",
                str(run_dir),
                "--save-rollouts",
                str(tmp / "rollouts"),
                "--export-hf",
                str(tmp / "export"),
            ],
            "faults": {"kill_server_at_step": 1, "nan_logprob_at_step": 2},
        }
    ]
    run_spec(tmp, spec)
    # The replays train on these batches: they must hold correct and wrong answers.
    recorded = [json.loads(line) for line in (tmp / "rollouts" / "index.jsonl").read_text().splitlines()]
    means = [r["reward_mean"] for r in recorded]
    assert any(0.0 < m < 1.0 for m in means[:2]), f"recorded rollouts have unmixed rewards: {means}"
    return tmp


def rows(run_dir: Path) -> list[dict]:
    return read_jsonl_metrics(run_dir / "metrics.jsonl")


def test_live_run_logs_every_metric_to_wandb(live):
    hist = read_wandb_history(live / "live" / "wandb")
    assert [int(r["_step"]) for r in hist] == list(range(1, LIVE_STEPS + 1))
    last = hist[-1]
    for key in (
        "reward/mean",
        "mismatch/kl",
        "mismatch/k3_kl",
        "mismatch/chi2_token",
        "mismatch/chi2_seq",
        "mismatch/log_ppl_abs_diff",
        "mismatch/training_ppl",
        "mismatch/rollout_ppl",
        "correction/weight_mean",
        "correction/ess",
        "acrl/alpha_abs_mean",
        "acrl/x",
        "acrl/y",
        "acrl/y_over_x",
        "loss/entropy",
        "response_length/mean",
        "time/rollout",
        "time/train",
        "time/sync",
        "sync/seconds",
        "sync/bytes",
        "perf/tokens_per_s",
        "grad_norm",
    ):
        assert key in last, key
        assert math.isfinite(float(last[key])), key
    assert 0.0 <= last["reward/mean"] <= 1.0
    assert last["mismatch/k3_kl"] >= 0 and last["mismatch/log_ppl_abs_diff"] >= 0
    assert last["acrl/x"] > 0 and last["sync/fp8_mode"] == 2.0  # fake-quant FP8 on the CPU server
    assert hist[0]["mismatch/log_ratio_hist/_type"] == "histogram"
    assert any(r.get("samples/_type") == "table-file" for r in hist)
    assert "eval/accuracy" in hist[1] and 0.0 <= hist[1]["eval/accuracy"] <= 1.0


def test_eval_runs_on_served_and_trainer_weights_then_restores_the_rollout_copy(live):
    """Every eval: greedy held-out accuracy and the sampled reward on fixed training prompts, on the
    served (FP8 fake-quant) weights and on the trainer's unquantized ones; the next step samples
    from the quantized copy again, under the step's own version."""
    r = rows(live / "live")
    for key in (
        "eval/accuracy",
        "eval/sampled_reward",
        "eval_trainer/accuracy",
        "eval_trainer/sampled_reward",
    ):
        assert 0.0 <= r[1][key] <= 1.0, key
        assert key not in r[0], key  # eval_interval=2
    after = load_rollouts(live / "rollouts", 2)  # step 3's batch, generated after step 2's eval
    assert set(after.weight_versions) == {"step-2"}
    assert r[2]["sync/fp8_mode"] == 2.0  # the step's own sync went out quantized


def test_killed_server_is_restarted_and_the_step_retried(live):
    r = rows(live / "live")
    assert [x["step"] for x in r] == list(range(1, LIVE_STEPS + 1))
    assert r[0]["rollout/server_restarts"] == 0 and r[1]["rollout/server_restarts"] == 1
    assert all(x["rollout/num_sequences"] == 16 for x in r)  # nothing lost
    state = json.loads((live / "live" / "state.json").read_text())
    assert state["prompts_consumed"] == 4 * LIVE_STEPS  # the failed step's prompts were reused, not skipped


def test_nonfinite_rollout_logprobs_are_masked_and_counted(live):
    r = rows(live / "live")
    assert r[2]["rollout/nonfinite_logprobs"] == 1 and r[1]["rollout/nonfinite_logprobs"] == 0
    for key in ("loss/pg_loss", "grad_norm", "mismatch/kl", "correction/weight_mean"):
        assert isinstance(r[2][key], float) and math.isfinite(r[2][key]), key


ALGOS = {
    "grpo": [],
    "dr_grpo": ["algorithm.grpo_norm_std=false", "algorithm.loss_agg=seq-mean-token-sum-norm"],
    "dapo": [
        "algorithm.clip_high=0.28",
        "algorithm.loss_agg=token-mean",
        "algorithm.dynamic_sampling=true",
        "algorithm.overlong_buffer_len=2",
    ],
    # Megatron critic + GAE; two minibatches per step, so policy and critic each take two steps.
    "ppo": ["algorithm.loss_agg=token-mean", "algorithm.num_minibatches=2"],
}
METHODS = ["none", "tis", "seq_tis", "seq_mis", "geo_mis", "icepop", "acrl"]


def test_every_algorithm_and_correction_trains_on_replayed_rollouts(live):
    spec = []
    for algo, extra in ALGOS.items():
        for method in METHODS:
            overrides = (
                BASE
                + extra
                + [
                    f"algorithm.name={algo}",
                    f"correction.method={method}",
                    "training.num_steps=2",
                    "logging.wandb_mode=disabled",
                ]
            )
            if method == "acrl":
                overrides.append("correction.masks=[seq_mis]")
            spec.append(
                {
                    "config": CONFIG,
                    "overrides": overrides,
                    "args": [
                        "--run-dir",
                        str(live / f"replay-{algo}-{method}"),
                        "--load-rollouts",
                        str(live / "rollouts"),
                    ],
                }
            )
    # PPO resume: the ppo/none run again, preempted after step 1, then resumed (policy + critic).
    ppo = next(item for item in spec if item["args"][1].endswith("replay-ppo-none"))
    ckpt = f"training.checkpoint_dir={live / 'ck-ppo'}"
    for name, faults in (("ppo-b", {"sigterm_at_train_step": 1}), ("ppo-c", {})):
        args = ["--run-dir", str(live / f"resume-{name}"), *ppo["args"][2:]]
        overrides = ppo["overrides"] + [ckpt]
        spec.append({"config": CONFIG, "overrides": overrides, "args": args, "faults": faults})
    run_spec(live, spec)
    for algo in ALGOS:
        for method in METHODS:
            r = rows(live / f"replay-{algo}-{method}")
            assert [x["step"] for x in r] == [1, 2], (algo, method)
            for x in r:
                assert math.isfinite(x["loss/pg_loss"]) and math.isfinite(x["grad_norm"]), (algo, method)
                assert x["rollout/replayed"] == 1.0
                if algo == "ppo":
                    for key in ("critic/value_loss", "critic/grad_norm", "critic/returns_mean"):
                        assert math.isfinite(x[key]), (method, key)
            # Non-zero advantages: the policy loss has a gradient (not just the entropy/KL terms).
            assert max(x["advantages/abs_mean"] for x in r) > 0.05, (algo, method)
            if method == "none":
                assert r[0]["correction/weight_mean"] == pytest.approx(1.0)
            if method == "acrl":
                assert r[0]["acrl/y_over_x"] == pytest.approx(1.0)  # first batch is the reference
    latest = json.loads((live / "ck-ppo" / "latest.json").read_text())
    for model in ("policy", "critic"):  # Megatron distributed checkpoints, one commit
        assert (live / "ck-ppo" / latest["dir"] / model / "metadata.json").exists(), model
    straight, resumed = rows(live / "replay-ppo-none"), rows(live / "resume-ppo-c")
    assert [x["step"] for x in rows(live / "resume-ppo-b")] == [1] and [x["step"] for x in resumed] == [2]
    for k, v in straight[1].items():  # the critic was restored too: its values feed GAE and the loss
        if not k.startswith(("time/", "perf/", "sync/seconds")):
            assert resumed[0][k] == v, k


def test_resume_continues_exactly(live):
    common = BASE + ["logging.wandb_mode=disabled", "training.save_interval=2"]
    replay = ["--load-rollouts", str(live / "rollouts")]
    spec = [
        {
            "config": CONFIG,
            "overrides": common + ["training.num_steps=4", f"training.checkpoint_dir={live / 'ck-a'}"],
            "args": ["--run-dir", str(live / "resume-a"), *replay],
        },
        {  # the same run, preempted (SIGTERM) during its 3rd step: it checkpoints step 3 and stops
            "config": CONFIG,
            "overrides": common + ["training.num_steps=4", f"training.checkpoint_dir={live / 'ck-b'}"],
            "args": ["--run-dir", str(live / "resume-b"), *replay],
            "faults": {"sigterm_at_train_step": 3},
        },
        {
            "config": CONFIG,
            "overrides": common + ["training.num_steps=4", f"training.checkpoint_dir={live / 'ck-b'}"],
            "args": ["--run-dir", str(live / "resume-c"), *replay],
        },
    ]
    run_spec(live, spec)
    a, b, c = rows(live / "resume-a"), rows(live / "resume-b"), rows(live / "resume-c")
    assert [x["step"] for x in b] == [1, 2, 3]  # stopped at the step boundary after SIGTERM
    assert json.loads((live / "resume-b" / "state.json").read_text())["step"] == 3
    assert [x["step"] for x in c] == [4]
    assert any(x["advantages/abs_mean"] > 0 for x in a[2:]), "resumed steps must have a policy gradient"
    skip = ("time/", "perf/", "sync/seconds")
    for ra, rc in zip(a[3:], c, strict=True):
        for k, v in ra.items():
            if not k.startswith(skip):
                assert rc[k] == v, (ra["step"], k)


def test_a_lagged_run_resumes_exactly(live):
    """Issue #36: a run with ``rollout.weight_lag_steps=2`` and 2 optimizer steps per RL step, stopped
    by SIGTERM after RL step 3 (its checkpoint directory is step_00000006, its lag buffer versions
    [1, 2, 3]), resumes (it was refused: the check compared optimizer steps with RL versions) and
    continues exactly as the run that was never stopped."""
    common = BASE + [
        "logging.wandb_mode=disabled",
        "training.save_interval=2",
        "training.num_steps=4",
        "rollout.weight_lag_steps=2",
        "algorithm.num_minibatches=2",
    ]
    replay = ["--load-rollouts", str(live / "rollouts")]
    ck = f"training.checkpoint_dir={live / 'ck-lag-b'}"
    spec = [
        {
            "config": CONFIG,
            "overrides": common + [f"training.checkpoint_dir={live / 'ck-lag-a'}"],
            "args": ["--run-dir", str(live / "lag-a"), *replay],
        },
        {
            "config": CONFIG,
            "overrides": common + [ck],
            "args": ["--run-dir", str(live / "lag-b"), *replay],
            "faults": {"sigterm_at_train_step": 5},  # optimizer steps: RL step 3's first
        },
        {"config": CONFIG, "overrides": common + [ck], "args": ["--run-dir", str(live / "lag-c"), *replay]},
    ]
    run_spec(live, spec)
    a, b, c = rows(live / "lag-a"), rows(live / "lag-b"), rows(live / "lag-c")
    assert [x["step"] for x in b] == [1, 2, 3] and [x["step"] for x in c] == [4]
    assert (live / "ck-lag-b" / "step_00000006").is_dir()  # optimizer steps name the directory
    for k, v in a[3].items():
        if not k.startswith(("time/", "perf/", "sync/seconds")):
            assert c[0][k] == v, k


def test_export_to_hf_safetensors(live):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    export = live / "export"
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "model.layers.1.mlp.down_proj.weight" in names
    model = AutoModelForCausalLM.from_pretrained(str(export))  # a normal HF directory
    assert model.config.num_hidden_layers == 2


def test_a_damaged_checkpoint_resumes_from_the_newest_intact_one(live):
    """4 KiB garbled inside a shard of the latest checkpoint (same size) once loaded without a word and
    trained on (issue #25): now the resume names it, keeps it, and continues exactly from the step
    before; the run saves that step again beside the damaged copy, never over it."""
    common = BASE + ["logging.wandb_mode=disabled", "training.save_interval=2", "training.num_steps=4"]
    ck = live / "ck-damaged"
    replay = ["--load-rollouts", str(live / "rollouts")]
    run = [f"training.checkpoint_dir={ck}"]
    run_spec(
        live,
        [{"config": CONFIG, "overrides": common + run, "args": ["--run-dir", str(live / "dmg-a"), *replay]}],
    )
    shard = sorted((ck / "step_00000004" / "policy").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[1024 : 1024 + 4096] = os.urandom(4096)
    shard.write_bytes(bytes(data))
    run_spec(
        live,
        [{"config": CONFIG, "overrides": common + run, "args": ["--run-dir", str(live / "dmg-b"), *replay]}],
    )
    a, b = rows(live / "dmg-a"), rows(live / "dmg-b")
    assert [x["step"] for x in b] == [3, 4]  # resumed from step 2, the newest intact one
    for ra, rb in zip(a[2:], b, strict=True):
        for k, v in ra.items():
            if not k.startswith(("time/", "perf/", "sync/seconds")):
                assert rb[k] == v, (ra["step"], k)
    assert (ck / "damaged-step_00000004" / "policy" / shard.name).read_bytes() == bytes(data)  # kept
    assert (select_step_dir(ck).step, select_step_dir(ck).passed_over) == (4, [])


@pytest.mark.slow
def test_a_stop_whose_servers_go_first_checkpoints_a_step_boundary(tmp_path):
    """SLURM's preemption signals the servers' step with the trainer's, so after the SIGTERM the
    servers may be gone before the step is done. The run does not restart servers going down with
    the job, and stops at a step boundary it checkpoints: a rollout that fails (the server killed
    before step 3's generation) ends the run at step 2, the failed try's prompts given back; a weight
    sync that fails (killed during step 2's update) ends step 2 without the servers (``sync/stopped``),
    which is checkpointed. Each resume trains the rest on the prompts an unstopped run would have:
    every step exactly once."""
    spec, cases = [], {"rollout": {"sigterm_and_kill_server_at_step": 2}}
    cases["sync"] = {"sigterm_and_kill_server_at_train_step": 2}
    for name, faults in cases.items():
        common = BASE + ["logging.wandb_mode=disabled", "training.num_steps=4", "training.save_interval=100"]
        common += [f"training.checkpoint_dir={tmp_path / name / 'ck'}"]  # no periodic one: the stop's only
        for part in ("a", "b"):
            args = ["--run-dir", str(tmp_path / name / part)]
            spec.append({"config": CONFIG, "overrides": common, "args": args})
        spec[-2]["faults"] = faults
    res = run_spec(tmp_path, spec)
    out = res.stdout + res.stderr
    (tmp_path / "out.log").write_text(out)
    assert "step 3: a stop was asked and then its rollout failed" in out
    assert "failed after a stop was asked" in out and "not recovered, the step ends without them" in out
    assert "re-sending weights and retrying" not in out and "and retry" not in out  # nothing restarted
    for name in cases:
        stopped, resumed = rows(tmp_path / name / "a"), rows(tmp_path / name / "b")
        assert [x["step"] for x in stopped] == [1, 2] and [x["step"] for x in resumed] == [3, 4], name
        assert all(x["rollout/server_restarts"] == 0 for x in stopped), name
        assert [x.get("sync/stopped", 0) for x in stopped] == ([0, 1] if name == "sync" else [0, 0])
        state = json.loads((tmp_path / name / "a" / "state.json").read_text())
        assert (state["step"], state["prompts_consumed"]) == (2, 4 * 2), name  # a failed try's went back
        # resumed from the stop's checkpoint (the only one before step 4), on the prompts of steps 3, 4
        assert json.loads((tmp_path / name / "b" / "state.json").read_text())["prompts_consumed"] == 16
