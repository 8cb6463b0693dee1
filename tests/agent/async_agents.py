"""Agents and fake servers for the async agent tests (``tests.agent.async_agents:Name`` in configs).

* :func:`three_turns`: an agent that always takes three turns (the opening, then "Again." twice),
  whatever the model says: multi-turn trajectories from an untrained model on a real server;
* :func:`digit_answer`: the fake backend's answer to it, ``"<k % 2>"`` each turn;
* :class:`HeldTurns`: a fake backend that stops the second turn of chosen questions after a few
  tokens until the servers serve a newer version (a weight update inside that turn, or with 0
  tokens between the turns) or until the test lets it go, so a test puts an update exactly where
  it wants it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from megatron_acrl.batch.staleness import parse_version
from megatron_acrl.rollout.agent.session import AgentSession
from megatron_acrl.tasks.base import Prompt
from sglang_bridge.samples import Sample, SamplingParams
from tests.fake_backend import EOS, CharTokenizer, FakeBackend

AGAIN = "Again."


async def three_turns(session: AgentSession, sample: Prompt) -> float:
    """Three turns, whatever the model says; reward 1 when the last turn's text is ``"0"``."""
    text = await session.generate([{"role": "user", "content": sample.text}])
    for _ in range(2):
        text = await session.generate([{"role": "user", "content": AGAIN}])
    return float(text.strip() == "0")


def digit_answer(prompt_ids: Sequence[int], k: int) -> list[int]:
    """The fake's turn for :func:`three_turns`: ``"<k % 2>"`` and the end of the turn."""
    return CharTokenizer().encode(f"{k % 2}<|im_end|>")


class HeldTurns(FakeBackend):
    """A fake whose turn ``turn`` (0-based: the number of ``Again.`` messages it follows, or of tool
    results) of a conversation holding one of ``held`` stops after ``after[question]`` tokens until
    the served version reaches ``until``, or, with ``release``, until that event is set (module
    doc). An ``abort`` pause ends a held turn aborted. :attr:`waiting` counts the turns held now."""

    def __init__(
        self,
        held: dict[str, int],
        *,
        turn: int = 1,
        until: int = 1,
        release: threading.Event | None = None,
        **kw: Any,
    ):
        super().__init__(**kw)
        self.held, self.turn, self.until, self.release = held, turn, until, release
        self.waiting = 0

    def _holding(self) -> bool:
        if self.release is not None:
            return not self.release.is_set()
        return parse_version(self.version) < self.until

    def _holds(self, prompt: Sequence[int]) -> int | None:
        text = CharTokenizer().decode(prompt)
        turns = text.count(AGAIN) + text.count("<|im_start|>tool\n")
        if turns != self.turn:
            return None
        user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        return self.held.get(user)

    async def _sample(self, prompt: Sequence[int], k: int, params: SamplingParams, fault: str) -> Sample:
        after = self._holds(prompt)
        if after is None or not self._holding():
            return await super()._sample(prompt, k, params, fault)
        text = self.answer(prompt, k)
        tokens = [*text, EOS][: params.max_new_tokens]
        epoch = self._abort_epoch
        out: list[int] = []
        versions: list[str] = []
        for j, tok in enumerate(tokens):
            held = j == after and self._holding()
            self.waiting += held
            try:
                while (j >= after and self._holding()) or not self._running.is_set():
                    await asyncio.sleep(0.001)
            finally:
                self.waiting -= held
            if self._abort_epoch != epoch:  # an abort pause came while it waited (or just before)
                self.aborted += 1
                return self._make(prompt, out, versions, "abort")
            out.append(tok)
            versions.append(self.version)
        return self._make(prompt, out, versions, "stop" if out[-1] == EOS else "length")
