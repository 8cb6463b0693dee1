"""Python-tool environment: the model runs Python in the sandbox, then answers; scored by the task's
reward (GSM8K-format data: ``task.name=gsm8k`` with ``rollout.agent.env=python``)."""

from __future__ import annotations

from typing import Any

from megatron_acrl.rollout.agent.envs.tool_env import RewardFn, ToolEnv
from megatron_acrl.rollout.agent.sandbox import Sandbox, SandboxOutcome
from megatron_acrl.rollout.agent.tools import ToolRegistry
from megatron_acrl.tasks.base import Prompt
from megatron_acrl.tasks.gsm8k import extract_answer

_ENDINGS: dict[SandboxOutcome, str] = {
    "cpu_time": "killed: CPU time limit exceeded",
    "memory": "killed: memory limit exceeded",
    "wall_time": "killed: wall time limit exceeded",
    "output_too_large": "killed: output too large",
    "killed": "killed by a signal",
}


class PythonTool:
    """Runs ``{"code": "..."}`` in a fresh sandbox; the result is its stdout, then its stderr and how
    it ended when it did not end cleanly (the model reads its own errors)."""

    name = "python"
    description = "Run a Python program in a sandbox (no network); returns what it prints."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"code": {"type": "string"}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox

    async def call(self, args: dict[str, Any]) -> str:
        res = await self.sandbox.run_python(args["code"])
        if res.outcome == "ok":
            return res.stdout
        tail = _ENDINGS.get(res.outcome, f"exit code {res.exit_code}")
        return f"{res.stdout}{res.stderr}[{tail}]"


def answer_reward(sample: Prompt, answer_text: str) -> float:
    """GSM8K's reward: 1.0 when the final answer's number equals the reference, else 0.0."""
    return 1.0 if extract_answer(answer_text) == sample.answer else 0.0


INSTRUCTIONS = (
    "You can run Python: "
    '<tool_call>{"name": "python", "arguments": {"code": "print(...)"}}</tool_call>. '
    "Then give the final answer as #### <number>."
)


class PythonEnv(ToolEnv):
    """Problems solved with the sandboxed Python tool; ``reward_fn`` is the task's (GSM8K's by default)."""

    name = "python"

    def __init__(
        self,
        sandbox: Sandbox,
        *,
        reward_fn: RewardFn = answer_reward,
        tool_timeout_s: float,
        tool_output_max_bytes: int,
        end_on_tool_error: bool = False,
    ):
        super().__init__(
            ToolRegistry.of([PythonTool(sandbox)]),
            reward_fn,
            instructions=INSTRUCTIONS,
            tool_timeout_s=tool_timeout_s,
            tool_output_max_bytes=tool_output_max_bytes,
            end_on_tool_error=end_on_tool_error,
        )
