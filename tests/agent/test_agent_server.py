"""Agent trajectories through real SGLang servers (issue #33's proof): token-in-token-out, the
server's own teacher-forced scoring, per-token bookkeeping, and affinity (the dispatch's pins, and
sglang-router's consistent hashing), measured as the prefix-cache hits the servers report.

The servers are the session's shared pair (``tests/conftest.py``); nothing here changes weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from megatron_acrl.batch.staleness import token_versions
from megatron_acrl.rollout.agent.direct import ServerBackend
from megatron_acrl.rollout.agent.loop import run_trajectory
from megatron_acrl.rollout.agent.session import AgentSession
from megatron_acrl.rollout.agent.templates import TINY_CHATML
from megatron_acrl.rollout.phase import sample_groups
from megatron_acrl.rollout.trajectories import _TextTokenizer
from megatron_acrl.tasks.base import Prompt
from sglang_bridge.client import SGLangClient
from sglang_bridge.router import RouterSpec, SGLangRouter
from sglang_bridge.samples import Sample, SamplingParams
from sglang_bridge.server import ServerGroup
from tests.fake_backend import make_ctx

TURNS = 4
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=12)
# The single-turn path's bound on |served - teacher-forced| log-probs (tests/test_async.py).
MAX_DLOGP, MEAN_DLOGP = 2e-2, 2e-3


async def four_turns(session: AgentSession, sample: Prompt) -> tuple[float, str]:
    """A scripted agent: the opening, then a user reply after each turn, ``TURNS`` turns in all."""
    await session.generate([{"role": "user", "content": sample.text}])
    for k in range(TURNS - 1):
        await session.generate([{"role": "user", "content": f"and then {k}?"}])
    return 1.0, "answered"


class Recorder(ServerBackend):
    """A :class:`ServerBackend` that keeps every (affinity, sample) it answered, in order."""

    def __init__(self, *a: Any, **k: Any):
        super().__init__(*a, **k)
        self.log: list[tuple[str | None, Sample]] = []

    def generate_async(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *, affinity: str | None = None
    ) -> asyncio.Future[list[Sample]]:
        fut = super().generate_async(prompt_ids, params, affinity=affinity)

        def keep(f: asyncio.Future[list[Sample]]) -> None:
            if not f.cancelled() and f.exception() is None:
                self.log += [(affinity, s) for s in f.result()]

        fut.add_done_callback(keep)
        return fut

    def by_key(self) -> dict[str, list[Sample]]:
        out: dict[str, list[Sample]] = {}
        for key, s in self.log:
            out.setdefault(str(key), []).append(s)
        return out


@pytest.fixture(scope="module")
def hf_tok(tiny_ckpt: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_ckpt))


def _probe_cached(url: str, seqs: Sequence[Sequence[int]]) -> list[int]:
    """The prefix of each sequence ``url``'s radix cache holds (a 1-token greedy request each)."""

    async def go() -> list[int]:
        async with SGLangClient(url) as c:
            out = []
            for s in seqs:
                sample = await c.generate_one(s, SamplingParams(temperature=0.0, max_new_tokens=1))
                out.append(int(sample.meta.get("cached_tokens", 0)))
            return out

    return asyncio.run(go())


def hit_rate(turns: Sequence[Sample]) -> tuple[int, int]:
    """(cached, cacheable) prompt tokens over turns >= 2 of one trajectory: what the server reported
    it found in its prefix cache, against the previous turn's whole sequence (prompt + output)."""
    cached = cacheable = 0
    for prev, cur in zip(turns, turns[1:], strict=False):
        cached += int(cur.meta.get("cached_tokens", 0))
        cacheable += len(prev.prompt_ids) + len(prev.output_ids)
    return cached, cacheable


def _set_version(urls: Sequence[str], version: str) -> None:
    async def go() -> None:
        for url in urls:
            async with SGLangClient(url) as c:
                await c.update_weight_version(version)

    asyncio.run(go())


@pytest.fixture(scope="module")
def agent_batch(server_group: ServerGroup, hf_tok: Any) -> Iterator[tuple[Any, Recorder]]:
    """Four trajectories (2 prompts x 2) of the scripted agent, through the rollout phase itself
    (:func:`~megatron_acrl.rollout.phase.sample_groups`) on both shared servers, which serve as
    version ``step-3`` for it (a run's trainer names each push so; the version goes back after)."""
    _set_version(server_group.urls, "step-3")
    try:
        yield from _agent_batch(server_group, hf_tok)
    finally:
        _set_version(server_group.urls, "default")


def _agent_batch(server_group: ServerGroup, hf_tok: Any) -> Iterator[tuple[Any, Recorder]]:
    backend = Recorder(server_group.urls, PARAMS)
    ctx = make_ctx(
        backend,
        [
            "rollout.agent.agent=test_agent_server:four_turns",
            "rollout.agent.max_trajectory_tokens=512",
            "rollout.max_new_tokens=12",
            "rollout.max_prompt_len=64",
        ],
        tokenizer=hf_tok,
    )
    prompts = [next(ctx.prompt_stream) for _ in range(2)]
    yield sample_groups(ctx, prompts, first_group=0), backend


def _rows(batch: Any, backend: Recorder) -> Iterator[tuple[int, list[int], list[Sample]]]:
    """Each batch row with its trained sequence and the samples its trajectory's turns came back as."""
    chains = backend.by_key()
    for row in range(len(batch)):
        found = None
        for turns in chains.values():
            last = turns[-1]
            n = len(last.prompt_ids) + len(last.output_ids)
            seq = batch.tokens[row, :n].tolist()
            if seq == [*last.prompt_ids, *last.output_ids] and int(batch.response_len[row]) == n - len(
                turns[0].prompt_ids
            ):
                found = (row, seq, turns)
        assert found is not None, f"row {row} is no trajectory the server generated"
        yield found


def test_trained_ids_logprobs_and_bookkeeping_are_the_servers(agent_batch: Any, hf_tok: Any) -> None:
    batch, backend = agent_batch
    assert len(batch) == 4 and batch.finish_reasons == ["answered"] * 4
    im_end = hf_tok.convert_tokens_to_ids("<|im_end|>")
    scored_rows = 0
    for row, seq, turns in _rows(batch, backend):
        assert len(turns) == TURNS
        width = batch.tokens.shape[1]
        want_mask, want_lp, want_turn, want_ver = ([0.0] * width, [0.0] * width, [-1] * width, [-1] * width)
        for k, s in enumerate(turns):
            lo, hi = len(s.prompt_ids), len(s.prompt_ids) + len(s.output_ids)
            # every request's ids are a prefix of the trained sequence, its output follows exactly
            assert seq[:lo] == s.prompt_ids and seq[lo:hi] == s.output_ids
            versions = token_versions(len(s.output_ids), s.weight_version, s.weight_versions)
            for j, t in enumerate(range(lo, hi)):
                want_mask[t], want_lp[t] = 1.0, s.rollout_logprobs[j]
                want_turn[t], want_ver[t] = k, versions[j]
            if k + 1 < len(turns):  # the appended ids: the boundary + the user's reply + the header
                appended = seq[hi : len(turns[k + 1].prompt_ids)]
                closed = s.output_ids[-1] == im_end
                text = hf_tok.decode(appended, skip_special_tokens=False)
                head = "" if closed else "<|im_end|>"
                assert text == f"{head}\n<|im_start|>user\nand then {k}?<|im_end|>\n<|im_start|>assistant\n"
        assert batch.loss_mask[row].tolist() == want_mask
        assert batch.rollout_logprobs[row].tolist() == pytest.approx(want_lp, abs=1e-6)
        assert batch.turn_ids[row].tolist() == want_turn
        assert batch.token_versions[row].tolist() == want_ver
        assert set(want_ver) == {-1, 3}
        # the server's own teacher-forced scoring of the whole trained sequence, on the server that
        # generated it: the rollout log-probs of the generated ids match it
        (scored,) = asyncio.run(_score(turns[-1].server, seq, len(seq) - len(turns[0].prompt_ids)))
        p = len(turns[0].prompt_ids)
        d = [abs(scored[t - p] - want_lp[t]) for t in range(p, len(seq)) if want_mask[t]]
        assert max(d) < MAX_DLOGP and sum(d) / len(d) < MEAN_DLOGP, (max(d), sum(d) / len(d))
        scored_rows += 1
    assert scored_rows == 4


async def _score(url: str, seq: list[int], k: int) -> list[list[float]]:
    async with SGLangClient(url) as c:
        return await c.score([seq], [k])


def test_a_trajectory_stays_on_its_server_and_hits_its_prefix_cache(agent_batch: Any) -> None:
    _batch, backend = agent_batch
    chains = backend.by_key()
    assert len(chains) == 4
    servers = {key: {s.server for s in turns} for key, turns in chains.items()}
    assert all(len(v) == 1 for v in servers.values()), servers  # every turn on one server
    assert len({next(iter(v)) for v in servers.values()}) == 2  # and the trajectories spread
    cached, cacheable = (sum(x) for x in zip(*(hit_rate(t) for t in chains.values()), strict=True))
    assert cached / cacheable >= 0.9, (cached, cacheable)


@pytest.mark.parametrize("policy", ["consistent_hashing"])
def test_the_router_hashes_a_trajectorys_turns_to_one_server(
    server_group: ServerGroup, hf_tok: Any, tmp_path: Path, policy: str
) -> None:
    """Through sglang-router 0.3.2 with ``consistent_hashing``: every turn carries the trajectory's
    id as ``X-SMG-Routing-Key``; the turns find their prefix cache (the router chose one worker),
    and a probe of each worker finds each trajectory cached on exactly one, both workers in use."""
    spec = RouterSpec(worker_urls=tuple(server_group.urls), policy=policy)
    keys = [f"router-proof-{i}" for i in range(8)]
    with SGLangRouter(spec, tmp_path / "router.log") as router:
        backend = Recorder([router.url], PARAMS, router=True)
        trajs = asyncio.run(_trajectories(backend, hf_tok, keys))
    chains = backend.by_key()
    cached, cacheable = (sum(x) for x in zip(*(hit_rate(chains[k]) for k in keys), strict=True))
    assert cached / cacheable >= 0.9, (cached, cacheable)
    seqs = [[*t.prompt_ids, *t.output_ids] for t in trajs]
    probes = [_probe_cached(url, seqs) for url in server_group.urls]
    owners = []
    for i, s in enumerate(seqs):
        holds = [p[i] >= len(s) - 1 for p in probes]
        assert sum(holds) == 1, (i, [p[i] for p in probes], len(s))
        owners.append(holds.index(True))
    assert set(owners) == {0, 1}, owners


async def _trajectories(backend: ServerBackend, hf_tok: Any, keys: Sequence[str]) -> list[Any]:
    tok = _TextTokenizer(hf_tok)
    sample = Prompt(text="What is 2 + 3?", answer="5", uid=0)

    async def one(key: str) -> Any:
        session = AgentSession(
            backend, PARAMS, tok, TINY_CHATML, max_turns=TURNS, max_tokens=512, affinity=key
        )
        return await run_trajectory(four_turns, session, sample)

    try:
        return list(await asyncio.gather(*(one(k) for k in keys)))
    finally:
        await backend.aclose()


def test_direct_backend_refuses_a_router_with_servers() -> None:
    with pytest.raises(ValueError, match="router's one URL"):
        ServerBackend(["http://a", "http://b"], router=True)
    with pytest.raises(ValueError, match="at least one"):
        ServerBackend([])
