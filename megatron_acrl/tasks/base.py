"""The task interface: prompts with a reference answer and a verifiable reward."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Prompt:
    """One task instance.

    Attributes:
        text: what the policy is asked (plain text; the rollout applies the tokenizer).
        answer: the reference answer used by the reward function and by SFT warm-start.
        uid: stable id (data position / group id); unique within a split.
    """

    text: str
    answer: str
    uid: int


class Task(Protocol):
    """A source of prompts plus a verifiable reward.

    ``prompts(split, seed)`` yields an endless, deterministic stream for ``train`` (reshuffled each
    epoch) and a fixed list for ``eval`` (disjoint from ``train``). ``reward`` returns 1.0 for a
    correct completion and 0.0 otherwise (tasks may give partial credit in between).
    """

    name: str

    def train_prompts(self, seed: int) -> Iterator[Prompt]: ...

    def eval_prompts(self, n: int) -> list[Prompt]: ...

    def reward(self, prompt: Prompt, completion: str) -> float: ...


def cycle_shuffled(items: list[Prompt], seed: int) -> Iterator[Prompt]:
    """Endless stream over ``items``, reshuffled each epoch with a seed derived from ``seed``."""
    if not items:
        raise ValueError("task has no training prompts")
    epoch = 0
    while True:
        order = list(items)
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        yield from order
        epoch += 1
