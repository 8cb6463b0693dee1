"""Guess-a-number: a multi-turn environment with feedback (higher / lower) and no tools."""

from __future__ import annotations

import random
import re

from megatron_acrl.rollout.agent.env import Step
from megatron_acrl.rollout.agent.templates import Message
from megatron_acrl.tasks.base import Prompt

_INT = re.compile(r"-?\d+")


def parse_guess(text: str) -> int | None:
    """The last integer in ``text`` (the model's guess), or None."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def feedback(guess: int | None, target: int) -> str:
    """What the env answers: ``correct``, ``higher`` (the target is larger), ``lower``, or a request
    for a number."""
    if guess is None:
        return "Answer with a number."
    if guess == target:
        return "correct"
    return "higher" if target > guess else "lower"


def guess_reward(guess: int | None, target: int) -> float:
    """1.0 for the right number, else 0.0."""
    return 1.0 if guess == target else 0.0


def guess_prompts(n: int, seed: int = 0, high: int = 100) -> list[Prompt]:
    """``n`` games with targets in [1, high] (deterministic in ``seed``)."""
    rng = random.Random(seed)
    text = f"I am thinking of a number between 1 and {high}. Guess it; I will say higher or lower."
    return [Prompt(text=text, answer=str(rng.randint(1, high)), uid=i) for i in range(n)]


class GuessNumberEnv:
    """Each turn the model guesses; the env says higher or lower until it is right (reward 1, reason
    solved). It never gives up on its own: wrap it in :class:`~megatron_acrl.rollout.agent.env.TurnLimit`."""

    name = "guess_number"

    def __init__(self) -> None:
        self.target: int | None = None

    async def reset(self, sample: Prompt) -> list[Message]:
        self.target = int(sample.answer)
        return [{"role": "user", "content": sample.text}]

    async def step(self, action_text: str) -> Step:
        if self.target is None:
            raise RuntimeError("guess_number: step() before reset()")
        guess = parse_guess(action_text)
        reward = guess_reward(guess, self.target)
        if reward > 0:
            return Step([], reward, True, "solved")
        return Step([{"role": "user", "content": feedback(guess, self.target)}], 0.0, False)
