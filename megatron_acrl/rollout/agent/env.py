"""The gym-style environment a generic multi-turn agent drives, and the turn limit around it.

An environment sees one task sample (:class:`~megatron_acrl.tasks.base.Prompt`) at a time::

    messages = await env.reset(sample)               # the opening messages (system, user)
    step = await env.step(action_text)               # the model's turn, as text
    step.observation, step.reward, step.done, step.reason

An observation is the list of chat messages to append (a tool's result as a ``tool`` message, a
user's reply as a ``user`` message); the agent tokenizes them as a suffix against the chat template
(:mod:`~megatron_acrl.rollout.agent.templates`), never re-encoding what the model generated.
``reason`` says why an episode ended (:data:`EndReason`): the env's own verdict, or a limit.
:class:`TurnLimit` ends an env that never says done after ``max_turns`` with reason ``max_turns``.

No torch or transformers here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from megatron_acrl.rollout.agent.templates import Message
from megatron_acrl.tasks.base import Prompt

EndReason = Literal[
    "answered", "solved", "max_turns", "max_tokens", "bad_call", "timeout", "error", "output_too_large"
]
"""Why an episode ended: answered (a final answer, right or wrong), solved (the env's goal reached),
max_turns / max_tokens (a limit: truncated), bad_call (malformed tool-call markup, an unknown tool or
bad arguments), timeout / error / output_too_large (a tool's failure, where the config ends the
episode on one)."""

TRUNCATIONS: frozenset[str] = frozenset({"max_turns", "max_tokens"})


@dataclass(frozen=True)
class Step:
    """What one turn gave: the messages to append (empty once done), the reward of this turn (an
    episode's return is the sum), whether the episode is over and why (None while it goes on)."""

    observation: list[Message]
    reward: float
    done: bool
    reason: EndReason | None = None
    info: dict = field(default_factory=dict)


class Env(Protocol):
    """A multi-turn environment: ``reset`` opens an episode on a sample, ``step`` takes the model's
    turn as text. Both are async (tools do I/O). An env instance runs one episode at a time."""

    name: str

    async def reset(self, sample: Prompt) -> list[Message]: ...

    async def step(self, action_text: str) -> Step: ...


class TurnLimit:
    """``env`` ended after ``max_turns`` model turns: the turn that reaches it returns done with
    reason ``max_turns`` (and the env's reward for that turn) when the env itself did not end."""

    def __init__(self, env: Env, max_turns: int):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.env, self.max_turns = env, max_turns
        self.name = env.name
        self.turns = 0

    async def reset(self, sample: Prompt) -> list[Message]:
        self.turns = 0
        return await self.env.reset(sample)

    async def step(self, action_text: str) -> Step:
        self.turns += 1
        step = await self.env.step(action_text)
        if not step.done and self.turns >= self.max_turns:
            return Step([], step.reward, True, "max_turns", step.info)
        return step
