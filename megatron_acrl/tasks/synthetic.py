"""Synthetic tasks with verifiable rewards that a tiny model learns on a CPU in minutes.

Each task draws its instances from a seeded generator; the evaluation split is a fixed set of
instances that never appear in training (split by a hash of the instance; ``heldout_fraction`` 0
trains on every instance). Addition with one or two digits is *enumerable*: :meth:`AdditionTask.
exact_prompts` lists every instance, which the exact metric (:mod:`megatron_acrl.rollout.evaluate`) scores.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from megatron_acrl.tasks.base import Prompt, cycle_shuffled

_FIRST_NUMBER = re.compile(r"-?\d+")


def _is_eval(key: str, eval_fraction: float = 0.1) -> bool:
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < eval_fraction


EXACT_LIMIT = 10_000
"""Most prompts an enumerable task lists for the exact metric (2-digit addition)."""


@dataclass
class _Synthetic:
    """Shared machinery: enumerate a finite instance space, split it, stream it."""

    name: str
    num_digits: int = 2
    pool_size: int = 4096
    heldout_fraction: float = 0.1
    """Fraction of instances held out of training (0: none, every instance trains)."""

    def _instance(self, rng: random.Random) -> tuple[str, str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _pool(self) -> tuple[list[Prompt], list[Prompt]]:
        if not hasattr(self, "_cache"):
            rng = random.Random(f"{self.name}-{self.num_digits}")
            seen: set[str] = set()
            train, evals = [], []
            for _ in range(self.pool_size * 4):
                text, answer = self._instance(rng)
                if text in seen:
                    continue
                seen.add(text)
                held = self.heldout_fraction > 0 and _is_eval(text, self.heldout_fraction)
                (evals if held else train).append(Prompt(text, answer, uid=len(seen)))
                if len(seen) >= self.pool_size:
                    break
            self._cache = (train, evals)
        return self._cache

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        return cycle_shuffled(self._pool()[0], seed)

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self._pool()[1][:n]

    def reward(self, prompt: Prompt, completion: str) -> float:
        """1.0 if the first answer-shaped thing in the completion equals the reference."""
        return 1.0 if self.extract(completion) == prompt.answer else 0.0

    def extract(self, completion: str) -> str | None:
        m = _FIRST_NUMBER.search(completion)
        return m.group(0) if m else None


class AdditionTask(_Synthetic):
    """``"12+34="`` -> ``"46"``."""

    def __init__(self, num_digits: int = 2, heldout_fraction: float = 0.1):
        super().__init__("addition", num_digits, heldout_fraction=heldout_fraction)

    def _instance(self, rng: random.Random) -> tuple[str, str]:
        hi = 10**self.num_digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return f"{a}+{b}=", str(a + b)

    def exact_prompts(self) -> list[Prompt]:
        """Every instance, ``"0+0="`` to ``"9+9="`` for one digit (100; 10,000 for two), held-out ones
        included, in a fixed order with ``uid`` = its index: what the exact metric averages over."""
        hi = 10**self.num_digits
        if hi * hi > EXACT_LIMIT:
            raise ValueError(
                f"{self.num_digits}-digit addition has {hi * hi} prompts, more than the exact metric "
                f"enumerates ({EXACT_LIMIT}); use num_digits <= 2"
            )
        return [Prompt(f"{a}+{b}=", str(a + b), uid=a * hi + b) for a in range(hi) for b in range(hi)]


class CountingTask(_Synthetic):
    """``"count a: abcab"`` -> ``"2"``: how often a letter occurs in a short string."""

    def __init__(self, num_digits: int = 2, heldout_fraction: float = 0.1):
        super().__init__("counting", num_digits, heldout_fraction=heldout_fraction)

    def _instance(self, rng: random.Random) -> tuple[str, str]:
        letters = "abcd"
        s = "".join(rng.choice(letters) for _ in range(rng.randint(3, 3 + 3 * self.num_digits)))
        c = rng.choice(letters)
        return f"count {c}: {s}=", str(s.count(c))


class SortingTask(_Synthetic):
    """``"sort 3 1 2="`` -> ``"1 2 3"``: sort a few single-digit numbers."""

    def __init__(self, num_digits: int = 2, heldout_fraction: float = 0.1):
        super().__init__("sorting", num_digits, heldout_fraction=heldout_fraction)

    def _instance(self, rng: random.Random) -> tuple[str, str]:
        xs = [rng.randint(0, 9) for _ in range(2 + self.num_digits)]
        return "sort " + " ".join(map(str, xs)) + "=", " ".join(map(str, sorted(xs)))

    def extract(self, completion: str) -> str | None:
        digits = re.findall(r"\d", completion.split("\n")[0])
        return " ".join(digits) if digits else None
