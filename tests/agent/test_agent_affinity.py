"""Affinity pins live as long as their trajectory: every turn of one trajectory goes to the server
its first turn went to, and the pin is dropped however the trajectory ends (finished, truncated,
stale and regenerated, its agent or its server failed, cancelled), so the dispatch's pin table does
not grow over a run. Through the real dispatch (:class:`~megatron_acrl.servers.dispatch.Dispatch`
behind :class:`~megatron_acrl.rollout.agent.direct.ServerBackend`) with in-memory clients: no
server, well under a second."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from megatron_acrl.batch.staleness import format_version
from megatron_acrl.rollout.agent.direct import ServerBackend
from megatron_acrl.rollout.agent.loop import run_trajectory
from megatron_acrl.rollout.agent.session import AgentSession
from megatron_acrl.rollout.agent.templates import TINY_CHATML
from megatron_acrl.rollout.trajectories import _TextTokenizer
from megatron_acrl.servers.dispatch import Dispatch
from megatron_acrl.tasks.base import Prompt
from sglang_bridge.samples import Sample
from sglang_bridge.transport import ServerGoneError
from tests.fake_backend import CharTokenizer

TOK = CharTokenizer()
URLS = ["http://s0", "http://s1", "http://s2"]
AGAIN = "Again."


class Client:
    """One server: answers every turn ``ok`` (then the end of the turn); a conversation holding
    ``FAIL`` loses its server on its second turn; ``HANG`` waits for ever (to be cancelled)."""

    def __init__(self, url: str, log: list[tuple[str, str]]):
        self.url, self.log = url, log

    async def generate_batch(self, prompts: Sequence[Sequence[int]], params: Any) -> list[Sample]:
        await asyncio.sleep(0)  # every other trajectory's turn interleaves here
        out = []
        for p in prompts:
            text = TOK.decode(p)
            self.log.append((self.url, text))
            if "FAIL" in text and AGAIN in text:
                raise ServerGoneError(f"{self.url} is gone")
            if "HANG" in text:
                await asyncio.Event().wait()
            ids = TOK.encode("ok<|im_end|>")
            out.append(Sample(list(p), ids, [-0.1] * len(ids), "stop", format_version(0), server=self.url))
        return out

    async def aclose(self) -> None:
        pass


def backend(log: list[tuple[str, str]]) -> ServerBackend:
    b = ServerBackend(URLS)
    b.dispatch = Dispatch(lambda url, cap: Client(url, log))
    return b


def session(b: ServerBackend, key: str, max_turns: int = 8) -> AgentSession:
    params = b.sampling_params()
    return AgentSession(
        b, params, _TextTokenizer(TOK), TINY_CHATML, max_turns=max_turns, max_tokens=4096, affinity=key
    )


async def three_turns(s: AgentSession, sample: Prompt) -> float:
    """Three turns; before each later one, the trajectory's pin is still the first turn's server.
    ``BOOM`` in the question: the agent raises after its first turn; ``STALE``: the engine marks
    the trajectory stale after it (its next turn ends it, as the async engine's staleness bound does)."""
    await s.generate([{"role": "user", "content": sample.text}])
    key = s.affinity
    assert key is not None
    first = s.backend.dispatch.pinned()[key]
    for _ in range(2):
        if "BOOM" in sample.text:
            raise RuntimeError("the agent's own bug")
        if "STALE" in sample.text:
            s.stale = True
        assert s.backend.dispatch.pinned()[key] == first  # the pin survives between turns
        await s.generate([{"role": "user", "content": AGAIN}])
    return 1.0


KINDS = {  # question -> (how the trajectory ends, max_turns)
    "q{}": ("answered", 8),
    "q{} long": ("max_turns", 2),
    "q{} BOOM": ("agent_error", 8),
    "q{} STALE": ("stale", 8),
    "q{} FAIL": ("server", 8),
}


def test_every_pin_is_dropped_when_its_trajectory_ends_and_survives_between_its_turns() -> None:
    log: list[tuple[str, str]] = []
    b = backend(log)
    per_kind = 40

    async def one(i: int, question: str, max_turns: int) -> str:
        s = session(b, f"traj-{i}", max_turns)
        try:
            traj = await run_trajectory(three_turns, s, Prompt(text=question.format(i), answer="", uid=i))
        except ServerGoneError:
            return "server"
        return traj.reason

    async def main() -> list[str]:
        jobs = [(q, kind, turns) for q, (kind, turns) in KINDS.items() for _ in range(per_kind)]
        return list(await asyncio.gather(*(one(i, q, t) for i, (q, _, t) in enumerate(jobs))))

    reasons = asyncio.run(main())
    assert sorted(reasons) == sorted(kind for kind, _ in KINDS.values() for _ in range(per_kind))
    assert b.dispatch.pinned() == {}  # 200 trajectories ended: nothing left pinned
    # every turn of a trajectory went to one server, and the load spread over all of them
    servers: dict[str, set[str]] = {}
    for url, text in log:
        question = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        servers.setdefault(question, set()).add(url)
    assert all(len(urls) == 1 for urls in servers.values())
    assert {u for urls in servers.values() for u in urls} == set(URLS)
    assert any(text.count(AGAIN) == 2 for _, text in log)  # three-turn trajectories were sent


def test_a_regenerated_trajectory_gets_a_new_key_and_a_cancelled_one_drops_its_pin() -> None:
    log: list[tuple[str, str]] = []
    b = backend(log)

    async def main() -> None:
        stale = session(b, "g0-s0-a1")
        traj = await run_trajectory(three_turns, stale, Prompt(text="q STALE", answer="", uid=0))
        assert traj.reason == "stale" and b.dispatch.pinned() == {}
        again = session(b, "g0-s0-a2")  # the engine's next attempt: a fresh key, any server
        assert (await run_trajectory(three_turns, again, Prompt(text="q", answer="", uid=0))).turns == 3
        hung = session(b, "g1-s0-a1")
        hang = Prompt(text="q HANG", answer="", uid=1)
        task = asyncio.ensure_future(run_trajectory(three_turns, hung, hang))
        while "g1-s0-a1" not in b.dispatch.pinned():
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert b.dispatch.pinned() == {} and b.in_flight() == dict.fromkeys(URLS, 0)
        hung.close()  # a second close does nothing

    asyncio.run(main())
