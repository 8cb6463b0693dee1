"""The shared shape of a tool-using environment: parse the model's calls, run them under the limits,
answer with their results, score the final answer."""

from __future__ import annotations

from collections.abc import Callable

from megatron_acrl.rollout.agent.env import Step
from megatron_acrl.rollout.agent.templates import Message
from megatron_acrl.rollout.agent.tools import ToolParseError, ToolRegistry, call_tool, parse_tool_calls
from megatron_acrl.tasks.base import Prompt

RewardFn = Callable[[Prompt, str], float]
"""(sample, final answer text) -> reward; pure."""


class ToolEnv:
    """A turn with tool calls runs them and returns their results as ``tool`` messages; a turn
    without calls is the final answer, scored by ``reward_fn``. A bad call or a tool failure ends the
    episode (reward 0, its reason) when ``end_on_tool_error``, else the model reads the error."""

    name = "tool_env"

    def __init__(
        self,
        registry: ToolRegistry,
        reward_fn: RewardFn,
        *,
        instructions: str,
        tool_timeout_s: float,
        tool_output_max_bytes: int,
        end_on_tool_error: bool = False,
    ):
        self.registry, self.reward_fn, self.instructions = registry, reward_fn, instructions
        self.tool_timeout_s, self.tool_output_max_bytes = tool_timeout_s, tool_output_max_bytes
        self.end_on_tool_error = end_on_tool_error
        self.sample: Prompt | None = None

    async def reset(self, sample: Prompt) -> list[Message]:
        self.sample = sample
        return [{"role": "system", "content": self.instructions}, {"role": "user", "content": sample.text}]

    async def step(self, action_text: str) -> Step:
        if self.sample is None:
            raise RuntimeError(f"{self.name}: step() before reset()")
        calls = parse_tool_calls(action_text, self.registry)
        if isinstance(calls, ToolParseError):
            info = {"tool_errors": 1, "parse_error": calls.kind}
            if self.end_on_tool_error:
                return Step([], 0.0, True, "bad_call", info)
            return Step([{"role": "tool", "content": f"error: {calls.message}"}], 0.0, False, None, info)
        if not calls:
            return Step([], self.reward_fn(self.sample, action_text), True, "answered")
        out: list[Message] = []
        errors = 0
        for call in calls:
            tool = self.registry.get(call.name)
            assert tool is not None  # parse_tool_calls checked the name
            res = await call_tool(
                tool,
                call.arguments,
                timeout_s=self.tool_timeout_s,
                max_output_bytes=self.tool_output_max_bytes,
            )
            out.append({"role": "tool", "content": res.text})
            if res.failure is not None:
                errors += 1
                if self.end_on_tool_error:
                    return Step([], 0.0, True, res.failure, {"tool_calls": len(calls), "tool_errors": errors})
        return Step(out, 0.0, False, None, {"tool_calls": len(calls), "tool_errors": errors})
