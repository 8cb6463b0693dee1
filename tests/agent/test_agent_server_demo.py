"""The agent demo's parts that need no server: the warm start's tool-call traces are the ids a
rollout holds for the same conversation (token-in-token-out), and the demo's report."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from megatron_acrl.config import ModelConfig, load_config
from megatron_acrl.rollout.agent.envs.calculator import INSTRUCTIONS, CalculatorEnv
from megatron_acrl.rollout.agent.loop import env_agent, run_trajectory
from megatron_acrl.rollout.agent.report import load_steps, report
from megatron_acrl.rollout.agent.session import AgentSession
from megatron_acrl.rollout.agent.templates import TINY_CHATML
from megatron_acrl.rollout.trajectories import _TextTokenizer
from megatron_acrl.tasks.base import Prompt
from megatron_acrl.warmstart.agent_traces import (
    CALCULATOR_INSTRUCTIONS,
    calculator_trace,
    hf_render,
    trace_ids,
)
from megatron_acrl.warmstart.tiny_model import build_checkpoint
from sglang_bridge.samples import Sample, SamplingParams

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "agent_demo.yaml"


class Scripted:
    """A backend that answers each turn with the next of ``turns`` (token ids)."""

    def __init__(self, turns: list[list[int]]):
        self.turns = list(turns)

    def generate_async(self, prompt_ids: Any, params: SamplingParams, *, affinity: str | None = None) -> Any:
        out = self.turns.pop(0)
        fut: asyncio.Future[list[Sample]] = asyncio.get_running_loop().create_future()
        sample = Sample(list(prompt_ids[0]), out, [-0.5] * len(out), "stop", "step-0")
        fut.set_result([sample])
        return fut


def test_a_warm_start_trace_is_what_a_rollout_of_it_holds(tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(build_checkpoint(ModelConfig())))
    sample = Prompt("347+829=", "1176", uid=0)
    messages = calculator_trace(sample.text, sample.answer)
    ids, mask = trace_ids(messages, hf_render(tok), lambda t: tok.encode(t, add_special_tokens=False))
    assert CALCULATOR_INSTRUCTIONS == INSTRUCTIONS
    # the rollout of the same episode: the model's turns are the trace's trained ids
    turns, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            turns.append(cur)
            cur = []
    turns.append(cur)
    assert len(turns) == 2
    env = CalculatorEnv(tool_timeout_s=5, tool_output_max_bytes=1024)
    session = AgentSession(
        Scripted(turns),
        SamplingParams(),
        _TextTokenizer(tok),
        TINY_CHATML,
        max_turns=3,
        max_tokens=1024,
        env=env,
    )
    traj = asyncio.run(run_trajectory(env_agent, session, sample))
    assert (traj.reason, traj.reward, traj.tool_calls) == ("answered", 1.0, 1)
    assert [*traj.prompt_ids, *traj.output_ids] == ids
    assert [0] * len(traj.prompt_ids) + traj.generated == mask


def test_the_demo_config_loads_and_its_report_reads_a_run(tmp_path: Path) -> None:
    cfg = load_config(CONFIG)
    assert cfg.rollout.agent.env == "calculator" and cfg.correction.method == "acrl"
    assert cfg.rollout.quantization == "fp8_block" and cfg.parallel.tp == 2
    rows = [
        {
            "step": s,
            "reward/mean": 0.1 * s,
            "rollout/num_sequences": 4,
            "agent/tool_calls": s,
            "agent/end_answered": 4,
        }
        for s in range(6)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"sft": 1}, *rows]))
    out = report(load_steps(tmp_path), window=2)
    assert out["reward rise"] == pytest.approx(0.4) and out["tool-call rate last"] == pytest.approx(4.5 / 4)
    assert out["answered frac last"] == 1.0
    with pytest.raises(ValueError, match="first and last 4"):
        report(load_steps(tmp_path), window=4)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found"):
        load_steps(tmp_path / "nope")
