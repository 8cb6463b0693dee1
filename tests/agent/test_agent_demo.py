"""`make agent-demo`'s parts: the warm start's traces (tool calls the env runs, direct answers only in
its last steps), the agent evaluation's schedule and the report's held-out figures; and (slow) the demo
config itself, shortened, through the real launcher: two Megatron ranks, a real SGLang server, the
held-out greedy trajectories logged at step 0 and at the end with their tool-call rate."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_acrl.config import load_config
from megatron_acrl.rollout.agent.envs.calculator import CalculatorEnv
from megatron_acrl.rollout.agent.report import eval_report, load_rows, main
from megatron_acrl.rollout.evaluate import eval_due
from megatron_acrl.tasks.base import Prompt
from megatron_acrl.warmstart.agent_traces import (
    COPY_WINDOW,
    DIRECT_FRACTION,
    MIXED_TAIL,
    calculator_trace,
    direct_answer,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "agent_demo.yaml"


def test_a_trace_call_is_what_the_calculator_env_runs_and_its_answer_scores_1() -> None:
    sample = Prompt("347+829=", "1176", uid=0)
    messages = calculator_trace(sample.text, sample.answer)
    env = CalculatorEnv(tool_timeout_s=5, tool_output_max_bytes=1024)

    async def episode() -> tuple[object, object]:
        await env.reset(sample)
        called = await env.step(messages[2]["content"])
        return called, await env.step(messages[4]["content"])

    called, answered = asyncio.run(episode())
    assert called.observation == [{"role": "tool", "content": "1176"}] and called.info["tool_calls"] == 1
    assert messages[3]["content"] == "1176" and (answered.done, answered.reward) == (True, 1.0)
    # compact, the arguments first: the copied operands sit close to the question
    assert messages[2]["content"].startswith('<tool_call>{"arguments":{"expression":"347+829"}')
    direct = calculator_trace(sample.text, sample.answer, use_tool=False)
    assert [m["role"] for m in direct] == ["system", "user", "assistant"] and direct[-1]["content"] == "1176"


def test_direct_answers_come_only_in_the_warm_starts_last_steps_at_their_rate() -> None:
    total = 400
    tail_start = total - round(MIXED_TAIL * total)
    assert not any(d for s in range(tail_start) for d in direct_answer(s, tail_start, 32, seed=1))
    tail = [d for s in range(tail_start, total) for d in direct_answer(s, tail_start, 32, seed=1)]
    assert abs(sum(tail) / len(tail) - DIRECT_FRACTION) < 0.05
    assert direct_answer(tail_start, tail_start, 32, seed=1) == direct_answer(
        tail_start, tail_start, 32, seed=1
    )


def test_the_mixed_tail_starts_once_the_copy_is_learned_or_at_the_latest_step() -> None:
    from megatron_acrl.warmstart.sft import _TraceSchedule

    early = _TraceSchedule(800, 120, seed=1)
    nlls = [0.5] * 300 + [0.02] * 500
    switched = [s for s in range(800) if s < early.total and early.observe(s, nlls[s])]
    assert switched == [300 + COPY_WINDOW - 1] and early.tail_start == 310 and early.total == 430
    assert not any(early.direct(s, 32)[0] for s in range(310)) and any(d for d in early.direct(310, 32))
    late = _TraceSchedule(800, 120, seed=1)  # never learned: the tail starts where it always did
    assert not any(late.observe(s, 0.25) for s in range(800)) and (late.tail_start, late.total) == (680, 800)


def test_an_agent_run_evaluates_at_step_0_every_interval_and_at_the_end() -> None:
    cfg = load_config(CONFIG, ["training.num_steps=25", "training.eval_interval=10"])
    assert [s for s in range(26) if eval_due(cfg, s)] == [0, 10, 20, 25]
    single = load_config(
        ROOT / "configs" / "demo.yaml", ["training.num_steps=25", "training.eval_interval=10"]
    )
    assert [s for s in range(26) if eval_due(single, s)] == [10, 20]  # as before
    off = load_config(CONFIG, ["training.eval_interval=0"])
    assert not any(eval_due(off, s) for s in range(31))


def test_the_report_prints_the_held_out_greedy_rise_and_tool_call_rate(tmp_path: Path, capsys) -> None:
    rows = [{"step": 0, "eval/accuracy": 0.1, "eval/tool_call_rate": 0.2}]
    rows += [
        {
            "step": s,
            "reward/mean": 0.1 * s,
            "rollout/num_sequences": 4,
            "agent/tool_calls": s,
            "agent/end_answered": 4,
        }
        for s in range(1, 7)
    ]
    rows[-1] |= {"eval/accuracy": 0.6, "eval/tool_call_rate": 1.0}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = eval_report(load_rows(tmp_path))
    assert figures["held-out greedy reward rise"] == pytest.approx(0.5)
    assert figures["held-out greedy tool-call rate last"] == 1.0 and figures["eval step last"] == 6
    main([str(tmp_path), "--window", "2"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "held-out greedy reward rise: 0.500" and "reward rise: 0.400" in out
    assert eval_report(rows[1:3]) == {}  # fewer than two evals: no held-out lines


@pytest.mark.slow
def test_the_agent_demo_config_runs_and_logs_held_out_agent_evals(tmp_path: Path) -> None:
    """The demo's config, shortened (a short warm start, 2 RL steps), as `make agent-demo` runs it."""
    run = tmp_path / "run"
    overrides = [
        "training.sft_steps=20",
        "training.num_steps=2",
        "training.eval_interval=5",
        "task.eval_size=8",
        "rollout.prompts_per_step=8",
        "training.micro_batch_size=16",
        f"training.checkpoint_dir={tmp_path / 'ckpt'}",
    ]
    cmd = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "megatron_acrl.train", "--config", str(CONFIG), "--run-dir", str(run), *overrides]
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    evals = [r for r in load_rows(run) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]  # the warm start, and the end
    for r in evals:
        assert 0.0 <= r["eval/accuracy"] <= 1.0 and r["eval/tool_call_rate"] >= 0.0
        assert 0.0 <= r["eval/answered_frac"] <= 1.0
    report = subprocess.run(
        [sys.executable, "-m", "megatron_acrl.rollout.agent.report", str(run), "--window", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert report.stdout.strip().splitlines()[-1].startswith("held-out greedy reward rise: ")
