"""Environments: pure rewards, episodes of each built-in env, the turn limit, and the factory."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from megatron_acrl.config import AgentConfig, TaskConfig
from megatron_acrl.rollout.agent.env import Step, TurnLimit
from megatron_acrl.rollout.agent.envs import (
    CalculatorEnv,
    GuessNumberEnv,
    make_env,
    multiplication_prompts,
)
from megatron_acrl.rollout.agent.envs.calculator import evaluate, exact_reward
from megatron_acrl.rollout.agent.envs.guess_number import feedback, guess_prompts, guess_reward, parse_guess
from megatron_acrl.rollout.agent.envs.python_tool import answer_reward
from megatron_acrl.tasks import make_task
from megatron_acrl.tasks.base import Prompt


def call(tool: str, **args) -> str:
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': args})}</tool_call>"


def episode(env, sample: Prompt, actions: list[str]) -> tuple[list, list[Step]]:
    async def go():
        obs = [await env.reset(sample)]
        steps = []
        for a in actions:
            steps.append(await env.step(a))
            obs.append(steps[-1].observation)
            if steps[-1].done:
                break
        return obs, steps

    return asyncio.run(go())


@pytest.mark.parametrize(
    "expr,want", [("347 * 829", 287663), ("2 + 3 * 4", 14), ("-(2 ** 10) // 3", -342), ("7 / 2", 3.5)]
)
def test_calculator_evaluates(expr, want):
    assert evaluate(expr) == want


@pytest.mark.parametrize(
    "expr",
    ["__import__('os')", "x", "abs(1)", "1 / 0", "10 ** 1000", "2 ** 2 ** 2 ** 2 ** 2", "'a' * 3", "1 +"],
)
def test_calculator_refuses(expr):
    with pytest.raises(ValueError):
        evaluate(expr)


def test_rewards_are_pure():
    p = Prompt("What is 2 * 3?", "6", 0)
    assert (
        exact_reward(p, "It is 6.") == 1.0
        and exact_reward(p, "It is 7.") == 0.0
        and exact_reward(p, "no") == 0.0
    )
    assert answer_reward(p, "#### 6") == 1.0
    assert (guess_reward(4, 4), guess_reward(3, 4), guess_reward(None, 4)) == (1.0, 0.0, 0.0)
    assert (feedback(3, 4), feedback(5, 4), feedback(4, 4)) == ("higher", "lower", "correct")
    assert parse_guess("I guess 12, no 13") == 13 and parse_guess("hm") is None


def test_prompts_are_deterministic():
    assert multiplication_prompts(5, seed=1) == multiplication_prompts(5, seed=1)
    p = multiplication_prompts(1, seed=1)[0]
    a, b = (int(x) for x in p.text.removeprefix("What is ").rstrip("?").split(" * "))
    assert 100 <= a <= 999 and int(p.answer) == a * b
    assert all(1 <= int(g.answer) <= 100 for g in guess_prompts(20))


def test_calculator_episode():
    env = CalculatorEnv(tool_timeout_s=5, tool_output_max_bytes=100)
    sample = multiplication_prompts(1)[0]
    expr = sample.text.removeprefix("What is ").rstrip("?")
    obs, steps = episode(
        env, sample, [call("calculator", expression=expr), f"The answer is {sample.answer}."]
    )
    assert obs[0][-1] == {"role": "user", "content": sample.text}
    assert obs[1] == [{"role": "tool", "content": sample.answer}]
    assert (steps[-1].reward, steps[-1].done, steps[-1].reason) == (1.0, True, "answered")
    _, steps = episode(env, sample, ["The answer is 1."])
    assert (steps[-1].reward, steps[-1].reason) == (0.0, "answered")


def test_bad_calls_end_or_are_shown_per_config():
    sample = multiplication_prompts(1)[0]
    ending = CalculatorEnv(tool_timeout_s=5, tool_output_max_bytes=100, end_on_tool_error=True)
    _, steps = episode(ending, sample, ["<tool_call>{oops</tool_call>"])
    assert (steps[-1].done, steps[-1].reason, steps[-1].reward) == (True, "bad_call", 0.0)
    _, steps = episode(ending, sample, [call("calculator", expression="1 / 0")])
    assert (steps[-1].done, steps[-1].reason) == (True, "error")
    going_on = CalculatorEnv(tool_timeout_s=5, tool_output_max_bytes=100)
    obs, steps = episode(going_on, sample, [call("nope", x=1), call("calculator", expression="1 / 0")])
    assert not steps[-1].done and obs[1][0]["content"].startswith("error: tool call 0: no tool 'nope'")
    assert "division by zero" in obs[2][0]["content"] and steps[0].info["tool_errors"] == 1


def test_guess_number_episode_and_turn_limit():
    sample = Prompt("guess", "37", 0)
    obs, steps = episode(GuessNumberEnv(), sample, ["50", "25", "37"])
    assert [o[0]["content"] for o in obs[1:3]] == ["lower", "higher"]
    assert (steps[-1].reward, steps[-1].reason) == (1.0, "solved")
    # An env that never says done is ended by max_turns, truncated.
    limited = TurnLimit(GuessNumberEnv(), max_turns=3)
    _, steps = episode(limited, sample, ["1"] * 10)
    assert len(steps) == 3 and (steps[-1].done, steps[-1].reason, steps[-1].observation) == (
        True,
        "max_turns",
        [],
    )
    with pytest.raises(ValueError):
        TurnLimit(GuessNumberEnv(), 0)


def test_python_env_over_gsm8k_is_one_config_line(tmp_path: Path):
    data = tmp_path / "gsm.jsonl"
    data.write_text(
        "\n".join(json.dumps({"question": f"What is {i} * 7?", "answer": f"#### {7 * i}"}) for i in range(4))
    )
    task = make_task(TaskConfig(name="gsm8k", data_path=str(data), eval_size=1))
    env = make_env(AgentConfig(env="python", max_turns=4), task)
    sample = next(task.train_prompts(0))
    n = int(sample.text.split()[2])
    obs, steps = episode(env, sample, [call("python", code=f"print({n} * 7)"), f"#### {7 * n}"])
    assert obs[1] == [{"role": "tool", "content": f"{7 * n}\n"}]
    assert (steps[-1].reward, steps[-1].reason) == (1.0, "answered")
    _, steps = episode(env, sample, [call("python", code="while True: pass")])
    assert "killed: CPU time limit exceeded" in steps[-1].observation[0]["content"]


def test_make_env(monkeypatch):
    assert make_env(AgentConfig(env="calculator", max_turns=2)).name == "calculator"
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    env = make_env(AgentConfig(env="sample_agents:NeverDone", max_turns=2))
    _, steps = episode(env, Prompt("x", "1", 0), ["a"] * 5)
    assert steps[-1].reason == "max_turns" and len(steps) == 2
    with pytest.raises(ValueError, match="null"):
        make_env(AgentConfig())
