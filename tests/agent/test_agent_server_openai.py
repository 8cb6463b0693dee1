"""The OpenAI-compatible session endpoint on a real SGLang server: an agent written against the
``openai`` client alone trains unchanged (its trajectory is token-in-token-out, with the server's
log-probs, versions and turns on every generated id); a call that rewrites history is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from megatron_acrl.rollout.agent.direct import ServerBackend
from megatron_acrl.rollout.agent.openai_server import (
    Endpoint,
    HistoryMismatch,
    new_messages,
    openai_agent,
    parse_reply,
)
from megatron_acrl.rollout.agent.session import AgentSession
from megatron_acrl.rollout.agent.templates import TINY_CHATML
from megatron_acrl.rollout.phase import sample_groups
from megatron_acrl.rollout.trajectories import _TextTokenizer
from sglang_bridge.client import SGLangClient
from sglang_bridge.samples import Sample, SamplingParams
from sglang_bridge.server import ServerGroup
from tests.fake_backend import make_ctx

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=24)
REPLIES: list[tuple[str, int]] = []
"""(content, completion_tokens) of every reply the agent below got, in order."""


@openai_agent
async def chat_agent(base_url: str, sample: Any) -> float:
    """Three turns, written against the openai client only (what a user brings)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample.text}]
    try:
        for k in range(3):
            r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=10)
            msg = r.choices[0].message
            REPLIES.append((msg.content or "", r.usage.completion_tokens if r.usage else -1))
            messages += [msg.model_dump(exclude_none=True), {"role": "user", "content": f"next {k}"}]
    finally:
        await client.close()
    return 1.0


class Recorder(ServerBackend):
    def __init__(self, *a: Any, **k: Any):
        super().__init__(*a, **k)
        self.log: list[Sample] = []

    def generate_async(self, prompt_ids: Any, params: SamplingParams, *, affinity: str | None = None) -> Any:
        fut = super().generate_async(prompt_ids, params, affinity=affinity)
        fut.add_done_callback(lambda f: self.log.extend(f.result()) if f.exception() is None else None)
        return fut


def _set_version(urls: Sequence[str], version: str) -> None:
    async def go() -> None:
        for url in urls:
            async with SGLangClient(url) as c:
                await c.update_weight_version(version)

    asyncio.run(go())


@pytest.fixture(scope="module")
def hf_tok(tiny_ckpt: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_ckpt))


@pytest.fixture(scope="module")
def openai_batch(server_group: ServerGroup, hf_tok: Any) -> Iterator[tuple[Any, Recorder]]:
    """The rollout phase with ``rollout.agent.agent`` naming the openai-client agent (servers at
    version ``step-5`` for it, put back after)."""
    _set_version(server_group.urls, "step-5")
    try:
        backend = Recorder(server_group.urls, PARAMS)
        ctx = make_ctx(
            backend,
            [
                "rollout.agent.agent=test_agent_server_openai:chat_agent",
                "rollout.agent.max_trajectory_tokens=512",
                "rollout.max_new_tokens=24",
                "rollout.max_prompt_len=64",
            ],
            tokenizer=hf_tok,
        )
        REPLIES.clear()
        yield sample_groups(ctx, [next(ctx.prompt_stream) for _ in range(2)], first_group=0), backend
    finally:
        _set_version(server_group.urls, "default")


def test_an_openai_client_agent_trains_unchanged(openai_batch: Any, hf_tok: Any) -> None:
    batch, backend = openai_batch
    assert len(batch) == 4 and batch.finish_reasons == ["answered"] * 4, batch.finish_reasons
    assert batch.rewards.tolist() == [1.0] * 4
    assert len(backend.log) == 12 == len(REPLIES)  # 4 trajectories x 3 turns, each one request
    # every reply is the text of the ids the server generated for it (the end-of-turn cut off)
    texts = sorted(hf_tok.decode(s.output_ids, skip_special_tokens=False) for s in backend.log)
    got = sorted(content for content, _ in REPLIES)
    assert [t.removesuffix("<|im_end|>") for t in texts] == got
    assert sorted(len(s.output_ids) for s in backend.log) == sorted(n for _, n in REPLIES)
    assert all(len(s.output_ids) <= 10 for s in backend.log)  # the call's max_tokens held
    for row in range(len(batch)):
        gen = batch.loss_mask[row] > 0
        turns = batch.turn_ids[row]
        assert set(turns[gen].tolist()) == {0, 1, 2} and (turns[~gen] == -1).all()
        assert (batch.token_versions[row][gen] == 5).all() and (batch.token_versions[row][~gen] == -1).all()
        lp = batch.rollout_logprobs[row]
        assert (lp[gen] < 0).all() and (lp[~gen] == 0).all()
        # the generated ids of the row are exactly the server's, turn by turn
        seq = batch.tokens[row].tolist()
        outs = [
            s
            for s in backend.log
            if seq[len(s.prompt_ids) : len(s.prompt_ids) + len(s.output_ids)] == s.output_ids
            and seq[: len(s.prompt_ids)] == s.prompt_ids
        ]
        assert sorted(len(s.prompt_ids) for s in outs) == sorted(
            i for i in range(1, len(seq)) if gen[i] and not gen[i - 1]
        )


def test_a_call_that_rewrites_history_is_refused(sglang_server: Any, hf_tok: Any) -> None:
    async def go() -> tuple[Any, str]:
        ep = await Endpoint().start()
        backend = ServerBackend([sglang_server.url], PARAMS)
        session = AgentSession(
            backend, PARAMS, _TextTokenizer(hf_tok), TINY_CHATML, max_turns=4, max_tokens=256
        )
        client = openai.AsyncOpenAI(base_url=ep.adopt(session), api_key="unused", max_retries=0)
        try:
            first = [{"role": "user", "content": "hello"}]
            r = await client.chat.completions.create(model="policy", messages=first)
            reply = r.choices[0].message.model_dump(exclude_none=True)
            with pytest.raises(openai.BadRequestError, match="n must be 1"):
                await client.chat.completions.create(model="policy", messages=first, n=2)
            rewritten = [{"role": "user", "content": "HELLO"}, reply, {"role": "user", "content": "go"}]
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="policy", messages=rewritten)
            return session, str(refused.value)
        finally:
            await client.close()
            await ep.close()
            await backend.aclose()

    session, err = asyncio.run(go())
    assert "message 0" in err and "append-only" in err
    assert session.traj.turns == 1  # the refused calls generated nothing


def test_replies_and_history_matching_without_a_server() -> None:
    text = 'I will call it. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    content, calls = parse_reply(text)
    assert content == "I will call it."
    assert calls[0]["function"] == {"name": "calculator", "arguments": '{"expression": "2*3"}'}
    assert parse_reply("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    held = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    sent = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "id": "call_0", "function": calls[0]["function"]}],
        },
        {"role": "tool", "content": "6", "tool_call_id": "call_0"},
    ]
    assert new_messages(held, sent) == [{"role": "tool", "content": "6"}]
    with pytest.raises(HistoryMismatch, match="send the whole conversation"):
        new_messages(held, sent[:2])
    with pytest.raises(HistoryMismatch, match="message 0"):
        new_messages(held, [{"role": "system", "content": "q"}, *sent[1:]])
