"""The agent loop on the fake backend: token-in-token-out trajectories in the batch, per-token
bookkeeping, a weight update mid-trajectory, faults that end one trajectory, affinity, metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from megatron_acrl.batch.staleness import format_version
from megatron_acrl.rollout.agent.loop import agent_signature_problem, env_agent, run_trajectory
from megatron_acrl.rollout.agent.session import AgentSession
from megatron_acrl.rollout.agent.templates import TINY_CHATML
from megatron_acrl.rollout.phase import rollout_metrics, sample_groups
from megatron_acrl.rollout.trajectories import _TextTokenizer
from megatron_acrl.tasks.base import Prompt
from tests.fake_backend import EOS, CharTokenizer, FakeBackend, calculator_answer, make_ctx

AGENT = ["rollout.agent.env=calculator", "rollout.max_new_tokens=128", "rollout.max_prompt_len=256"]


class Recording(FakeBackend):
    """A fake that keeps every sample it returned, in order."""

    def __init__(self, *a, **k):  # noqa: ANN002, ANN003
        super().__init__(*a, **k)
        self.samples: list = []

    def _make(self, prompt, out, versions, finish):  # noqa: ANN001
        s = super()._make(prompt, out, versions, finish)
        self.samples.append(s)
        return s


def _batch(fake: FakeBackend, extra: Sequence[str] = ()):
    ctx = make_ctx(fake, [*AGENT, *extra])
    prompts = [next(ctx.prompt_stream) for _ in range(2)]
    return ctx, prompts, sample_groups(ctx, prompts, first_group=0)


def test_trained_ids_are_the_generated_ids_plus_the_observation_ids() -> None:
    fake = Recording(calculator_answer, max_new_tokens=128)
    ctx, prompts, b = _batch(fake)
    assert len(b) == 4 and b.finish_reasons == ["answered"] * 4
    assert b.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]  # k odd answers the result + 1
    by_prompt: dict[tuple, list] = {}
    for s in fake.samples:
        by_prompt.setdefault(tuple(s.prompt_ids), []).append(s)
    tok = CharTokenizer()
    for row in range(len(b)):
        p = int((b.tokens[row] != 0).nonzero().max()) + 1
        seq = b.tokens[row, :p].tolist()
        gen = b.loss_mask[row, :p] > 0
        turns = b.turn_ids[row, :p]
        # every request's ids are a prefix of the trained sequence, and its output follows it exactly
        starts = [i for i in range(1, p) if gen[i] and not gen[i - 1]]
        assert len(starts) == 2
        for k, start in enumerate(starts):
            # one of the samples sent with exactly these ids (a group's two share a prompt)
            match = [
                s
                for s in by_prompt[tuple(seq[:start])]
                if seq[start : start + len(s.output_ids)] == s.output_ids
            ]
            assert match
            sample = match[0]
            out = sample.output_ids
            assert gen[start : start + len(out)].all() and (turns[start : start + len(out)] == k).all()
            lp = b.rollout_logprobs[row, start : start + len(out)].tolist()
            assert lp == pytest.approx(sample.rollout_logprobs)
        # the non-generated ids after the prompt are the template's suffix: the whole sequence is the
        # rendered conversation (EOS aside)
        assert seq[-1] == EOS
        text = tok.decode(seq)
        assert "<|im_start|>tool\n" in text and text.endswith("<|im_end|>")
        # off the generated ids: loss 0, log-prob 0, version -1, turn -1
        off = ~gen
        assert (b.rollout_logprobs[row, :p][off] == 0).all()
        assert (b.token_versions[row, :p][off] == -1).all() and (b.token_versions[row, :p][gen] == 0).all()
        assert (turns[off] == -1).all()
    m = rollout_metrics(b)
    assert m["agent/turns_mean"] == 2.0 and m["agent/tool_calls"] == 4.0 and m["agent/tool_errors"] == 0.0
    assert m["agent/truncated_frac"] == 0.0 and m["agent/end_answered"] == 4.0
    assert m["agent/tokens_generated"] == float(b.loss_mask.sum())
    assert m["agent/tokens_observation"] > 0 and m["agent/tokens_boundary"] > 0


def test_rendered_sequence_matches_the_template_token_for_token() -> None:
    """The whole trajectory equals the template's rendering of the conversation it held."""
    fake = Recording(calculator_answer, max_new_tokens=128)
    ctx, prompts, b = _batch(fake)
    from megatron_acrl.rollout.agent.envs.calculator import INSTRUCTIONS

    tok = CharTokenizer()
    row = 0
    p = int((b.tokens[row] != 0).nonzero().max()) + 1
    texts = b.completions[row].split(" | ")
    conv = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": prompts[0].text},
        {"role": "assistant", "content": texts[0]},
        {"role": "tool", "content": str(eval(prompts[0].text.rstrip("=")))},  # noqa: S307 - "a+b"
        {"role": "assistant", "content": texts[1]},
    ]
    rendered = TINY_CHATML.render(conv)
    # the fake ends each turn with <|im_end|> and then its own EOS id, which the template never renders
    assert tok.encode(rendered.removesuffix("\n")) == [t for t in b.tokens[row, :p].tolist() if t != EOS]


def test_affinity_pins_each_trajectory_to_one_key() -> None:
    fake = FakeBackend(calculator_answer, max_new_tokens=128)
    _batch(fake)
    keys = fake.affinities
    assert len(keys) == 8 and all(k is not None for k in keys)
    assert len(set(keys)) == 4 and all(keys.count(k) == 2 for k in set(keys))


def test_weight_update_inside_a_turn_records_versions_per_token() -> None:
    fake = FakeBackend(lambda p, k: calculator_answer(p, 0), max_new_tokens=128, pause_at_token=3)

    async def main():
        session = AgentSession(
            fake,
            fake.sampling_params(),
            _TextTokenizer(CharTokenizer()),
            TINY_CHATML,
            max_turns=4,
            max_tokens=2048,
            affinity="t0",
            env=__import__("megatron_acrl.rollout.agent.envs", fromlist=["CalculatorEnv"]).CalculatorEnv(
                tool_timeout_s=5, tool_output_max_bytes=100
            ),
        )

        async def push() -> None:
            while not fake.paused_midway.is_set():
                await asyncio.sleep(0.001)
            fake.update_weights([], format_version(1))

        pusher = asyncio.ensure_future(push())
        traj = await run_trajectory(env_agent, session, Prompt(text="2+3=", answer="5", uid=0))
        await pusher
        return traj

    traj = asyncio.run(main())
    from megatron_acrl.rollout.trajectories import trajectory_versions

    v = trajectory_versions(traj)
    gen = [i for i, g in enumerate(traj.generated) if g]
    assert [v[i] for i in gen[:3]] == [0, 0, 0] and all(v[i] == 1 for i in gen[3:])
    assert all(v[i] == -1 for i, g in enumerate(traj.generated) if not g)
    assert traj.reason == "answered" and traj.reward == 1.0


def _malformed(prompt_ids: Sequence[int], k: int) -> list[int]:
    return CharTokenizer().encode('<tool_call>{"name": calculator<|im_end|>')


def _chatty(prompt_ids: Sequence[int], k: int) -> list[int]:
    return CharTokenizer().encode(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call><|im_end|>'
    )


@pytest.mark.parametrize(
    ("answer", "extra", "reason"),
    [
        (_malformed, ["rollout.agent.end_on_tool_error=true"], "bad_call"),
        (_chatty, ["rollout.agent.max_turns=3"], "max_turns"),
        (_chatty, ["rollout.agent.max_trajectory_tokens=300"], "max_tokens"),
        (calculator_answer, ["rollout.agent.agent=tests.agent.sample_agents:RaisingAgent"], "agent_error"),
    ],
)
def test_each_fault_ends_its_trajectory_with_its_reason_and_the_step_goes_on(answer, extra, reason) -> None:  # noqa: ANN001
    fake = FakeBackend(answer, max_new_tokens=128)
    ctx, prompts, b = _batch(fake, extra)
    assert len(b) == 4 and b.finish_reasons == [reason] * 4
    assert b.rewards.tolist() == [0.0] * 4
    m = rollout_metrics(b)
    assert m[f"agent/end_{reason}"] == 4.0
    if reason in ("max_turns", "max_tokens"):
        assert m["agent/truncated_frac"] == 1.0
    if reason == "max_tokens":
        assert all(int((b.tokens[i] != 0).sum()) <= 300 for i in range(4))
    # whatever ended it, the bookkeeping stays aligned
    assert ((b.turn_ids >= 0) == (b.loss_mask > 0)).all()


def test_a_malformed_call_is_shown_to_the_model_when_errors_do_not_end_it() -> None:
    fake = FakeBackend(_malformed, max_new_tokens=128)
    _, _, b = _batch(fake, ["rollout.agent.max_turns=2"])
    m = rollout_metrics(b)
    assert b.finish_reasons == ["max_turns"] * 4 and m["agent/tool_errors"] == 8.0


def test_an_agent_with_the_wrong_signature_is_refused() -> None:
    from megatron_acrl.config import load_config

    async def one_arg(session):  # noqa: ANN001
        return 0.0

    assert agent_signature_problem(one_arg) is not None
    assert agent_signature_problem(env_agent) is None
    with pytest.raises(Exception, match="agent\\(session, sample\\)"):
        load_config(None, ["rollout.agent.agent=tests.agent.sample_agents:one_arg_agent"])


def test_single_turn_batches_are_unchanged_but_for_turn_zero() -> None:
    fake = FakeBackend()
    ctx = make_ctx(fake)
    prompts = [next(ctx.prompt_stream) for _ in range(2)]
    b = sample_groups(ctx, prompts, first_group=0)
    assert ((b.turn_ids == 0) == (b.loss_mask > 0)).all()
    assert b.agent_rows == [] and "agent/turns_mean" not in rollout_metrics(b)
    assert torch.equal(b.tensors()["turn_ids"], b.turn_ids)


def test_dispatch_pins_an_affinity_key_to_its_first_target() -> None:
    from megatron_acrl.servers.dispatch import Dispatch

    class Client:
        async def generate_batch(self, prompts, params):  # noqa: ANN001
            return [None] * len(prompts)

    async def main() -> list[str]:
        d = Dispatch(lambda url, cap: Client())
        sent = []
        for key in ("a", "b", "a", "a", "b"):
            before = dict(d._counts)
            fut = d.send(["s0", "s1"], [[1]], None, cap=4, affinity=key)
            sent.append(next(u for u in ("s0", "s1") if d._counts.get(u, 0) > before.get(u, 0)))
            # leave it in flight: least-loaded alone would now pick the other server
            _ = fut
        d.unpin("a")
        return sent

    sent = asyncio.run(main())
    assert sent[0] == sent[2] == sent[3] and sent[1] == sent[4] and sent[0] != sent[1]
