"""Tool-call traces for the supervised warm start of an agent (``rollout.agent.env: calculator``):
the conversation a correct calculator episode has, tokenized the way the rollout builds a
trajectory, with the loss on the assistant's turns only.

A trace of ``"347+829="`` (answer ``1176``)::

    system     CALCULATOR_INSTRUCTIONS
    user       347+829=
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "347+829"}}</tool_call>
    tool       1176
    assistant  1176

Rendered with the tokenizer's own chat template and cut where the rollout cuts it (each assistant
turn's text and its end-of-turn string are what the model generates; everything else, the ``"\\n"``
after an end-of-turn included, is an observation or a boundary) and each piece tokenized on its own,
as token-in-token-out does: the ids the warm start trains are the ids a rollout would hold.

Pure Python (no torch): the calculator env imports :data:`CALCULATOR_INSTRUCTIONS` from here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

CALCULATOR_INSTRUCTIONS = (
    "Use the calculator tool for arithmetic: "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>. '
    "Then give the final answer as a number."
)
"""The calculator env's system message (``megatron_acrl.rollout.agent.envs.calculator``)."""

END_OF_TURN = "<|im_end|>"

Render = Callable[[Sequence[dict[str, Any]], bool], str]
"""``(messages, add_generation_prompt) -> text``: a chat template."""


def calculator_trace(question: str, answer: str) -> list[dict[str, Any]]:
    """The messages of a correct calculator episode on ``question`` (e.g. ``"347+829="``)."""
    expression = question.strip().removeprefix("What is").strip().rstrip("=?").strip()
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return [
        {"role": "system", "content": CALCULATOR_INSTRUCTIONS},
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": answer},
    ]


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
