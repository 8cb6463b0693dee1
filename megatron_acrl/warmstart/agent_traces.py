"""Tool-call traces for the supervised warm start of an agent (``rollout.agent.env: calculator``):
the conversation a correct calculator episode has, tokenized the way the rollout builds a
trajectory, with the loss on the assistant's turns only.

A trace of ``"347+829="`` (answer ``1176``)::

    system     CALCULATOR_INSTRUCTIONS
    user       347+829=
    assistant  <tool_call>{"arguments":{"expression":"347+829"},"name":"calculator"}</tool_call>
    tool       1176
    assistant  1176

and its direct twin (no tool: the answer at once, which the tiny model cannot compute)::

    system     CALCULATOR_INSTRUCTIONS
    user       347+829=
    assistant  1176

The call is compact JSON with the arguments first, so that the operands the model copies sit as
close to the question as the markup allows: the 2-layer model learns to copy by attending back a
fixed distance, and a short distance inside a short sequence is what it learns within the warm
start's few hundred steps (measured: with the long instructions and ``{"name": ..., "arguments":``
first, 300 steps never copied an operand; this form copies after ~350).

:func:`direct_answer` picks the direct traces of the warm start's last steps
(:data:`MIXED_TAIL`, :data:`DIRECT_FRACTION`): the model first learns the tool (copy the operands,
then the result: the warm start trains tool traces alone until their NLL has stayed below
:data:`COPY_NLL`, because when the copy is learned depends on the seed, 350 to 500+ steps), then that
answering at once is also something it does; RL starts from a policy
that calls the calculator part of the time and is right when it does, so GRPO groups differ and
RL has something to learn: call the tool.

Rendered with the tokenizer's own chat template and cut where the rollout cuts it (each assistant
turn's text and its end-of-turn string are what the model generates; everything else, the ``"\\n"``
after an end-of-turn included, is an observation or a boundary) and each piece tokenized on its own,
as token-in-token-out does: the ids the warm start trains are the ids a rollout would hold.

Pure Python (no torch): the calculator env imports :data:`CALCULATOR_INSTRUCTIONS` from here.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from typing import Any

CALCULATOR_INSTRUCTIONS = "Use the calculator."
"""The calculator env's system message (``megatron_acrl.rollout.agent.envs.calculator``). Short on
purpose: every id of it is attended over at every position (the tiny model learns the call format
from the traces, not from prose), and the ~150-id explicit form kept the copy from being learned."""

MIXED_TAIL = 0.15
"""The fraction of the warm start's steps, at its end, whose traces include direct answers."""

DIRECT_FRACTION = 0.6
"""In those steps, the chance that a trace answers directly instead of calling the calculator."""

COPY_NLL = 0.05
"""The tool traces' token NLL (mean of the last :data:`COPY_WINDOW` steps) below which the copy counts
as learned and the mixed tail starts: on the plateau before it every operand digit is a guess (NLL
~0.2-0.27); once the model copies, it falls to ~0.02 within a few dozen steps."""

COPY_WINDOW = 10
"""Steps the NLL is averaged over for :data:`COPY_NLL` (single batches are noisy)."""

END_OF_TURN = "<|im_end|>"

Render = Callable[[Sequence[dict[str, Any]], bool], str]
"""``(messages, add_generation_prompt) -> text``: a chat template."""


def calculator_trace(question: str, answer: str, *, use_tool: bool = True) -> list[dict[str, Any]]:
    """The messages of a correct calculator episode on ``question`` (e.g. ``"347+829="``): call the
    calculator, then answer its result; with ``use_tool=False`` the answer at once."""
    opening = [
        {"role": "system", "content": CALCULATOR_INSTRUCTIONS},
        {"role": "user", "content": question},
    ]
    if not use_tool:
        return [*opening, {"role": "assistant", "content": answer}]
    expression = question.strip().removeprefix("What is").strip().rstrip("=?").strip()
    call = {"arguments": {"expression": expression}, "name": "calculator"}
    return [
        *opening,
        {"role": "assistant", "content": f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": answer},
    ]


def direct_answer(step: int, tail_start: int, n: int, seed: int) -> list[bool]:
    """Which of warm-start step ``step``'s ``n`` traces answer directly (no tool): none before
    ``tail_start`` (the mixed tail's first step), then each with probability :data:`DIRECT_FRACTION`
    (deterministic in ``seed`` and ``step``)."""
    if step < tail_start:
        return [False] * n
    rng = random.Random(seed * 1_000_003 + step)
    return [rng.random() < DIRECT_FRACTION for _ in range(n)]


def trace_segments(messages: Sequence[dict[str, Any]], render: Render) -> list[tuple[str, bool]]:
    """``messages`` cut into ``(text, trained)`` pieces whose concatenation is the rendered
    conversation: trained = an assistant turn's text with its end-of-turn string."""
    out: list[tuple[str, bool]] = []
    held = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(messages[:i], True)
        after = render(messages[: i + 1], False)
        if not prompt.startswith(held) or not after.startswith(prompt):
            raise ValueError(f"the chat template is not append-only at message {i}")
        turn = after[len(prompt) :]
        if END_OF_TURN not in turn:
            raise ValueError(f"the chat template does not close an assistant turn with {END_OF_TURN!r}")
        cut = turn.index(END_OF_TURN) + len(END_OF_TURN)
        out += [(prompt[len(held) :], False), (turn[:cut], True)]
        held = prompt + turn[:cut]
    return [(t, trained) for t, trained in out if t]


def trace_ids(
    messages: Sequence[dict[str, Any]], render: Render, encode: Callable[[str], list[int]]
) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a trace: each piece of :func:`trace_segments` encoded on its own."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in trace_segments(messages, render):
        part = encode(text)
        ids += part
        mask += [int(trained)] * len(part)
    return ids, mask


def hf_render(tokenizer: Any) -> Render:
    """The tokenizer's own chat template as a :data:`Render`."""

    def render(messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        return str(
            tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    return render
