"""Chat templates for token-in-token-out trajectories, and the append-only checker.

The rule: a trajectory is the exact token ids the servers generated plus the exact ids of each
observation, appended. Generated ids are never decoded and re-encoded into the trained sequence.
An observation (a tool result, a user's reply) is tokenized as a *suffix* against the chat template:
render the conversation with and without the new messages and tokenize only the appended text
(:func:`observation_suffix`). That is exact only when rendering is append-only (each turn's
rendering is a prefix of the next); :func:`check_append_only` verifies it and refuses a template that
is not (a Qwen3-style template that strips earlier ``<think>`` blocks, say), naming the turn and the
position where it diverges.

Tokens the template inserts between a generated turn and the observation (the ``<|im_end|>`` a
truncated turn never generated, the ``"\\n"`` after ``<|im_end|>``, the next assistant header) are
*boundary* tokens: loss 0 and no log-prob, like the observation's own.

Two templates written by us ship: :data:`TINY_CHATML` (the tiny tokenizer's, with tool-call markup;
the same source as ``megatron_acrl.warmstart.tiny_model.CHAT_TEMPLATE``) and :data:`QWEN_STYLE`
(Qwen2.5-style: tools listed in the system turn, tool results as ``<tool_response>`` in a user turn).

Jinja2 only; no torch or transformers (a tokenizer is anything with ``encode``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = dict[str, Any]
"""A chat message: ``role`` (system, user, assistant, tool) and ``content`` (text); an assistant
message may carry ``tool_calls`` ([{"name", "arguments"}]) rendered as tool-call markup."""

TokenKind = Literal["boundary", "observation"]


class Tokenizer(Protocol):
    """What the suffix tokenization needs: text to ids (special tokens in the text are recognised,
    no BOS/EOS added). ``HFTokenizer`` adapts a Hugging Face tokenizer."""

    def encode(self, text: str) -> list[int]: ...


class HFTokenizer:
    """A Hugging Face tokenizer as a :class:`Tokenizer` (``add_special_tokens=False``)."""

    def __init__(self, tok: Any):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))


_TOOL_CALLS = (
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>"
    '{{ {"name": c["name"], "arguments": c["arguments"]} | tojson }}</tool_call>'
    "{% endfor %}{% endif %}"
)
# Hugging Face renders chat templates with trim_blocks and lstrip_blocks (a newline right after a
# block tag is dropped), and so do we: every literal newline below sits before a tag, never after.

TINY_CHATML_SOURCE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    + _TOOL_CALLS
    + "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The tiny tokenizer's ChatML template: without tools or tool calls it renders exactly as the
tokenizer's first template did (``<|im_start|>role\\ncontent<|im_end|>\\n`` per message)."""

QWEN_STYLE_SOURCE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages and messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first %}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}" + _TOOL_CALLS + "<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A Qwen2.5-style template written by us: the tools block in the system turn, consecutive tool
results joined into one user turn of ``<tool_response>`` blocks."""


class TemplateNotAppendOnly(ValueError):
    """Rendering a conversation is not append-only: ``turn`` (the message index whose addition
    rewrote earlier text) and ``position`` (the first differing character) say where."""

    def __init__(self, template: str, turn: int, position: int, before: str, after: str):
        self.turn, self.position = turn, position
        super().__init__(
            f"chat template {template!r} is not append-only: adding message {turn} changes the text "
            f"already rendered at character {position} ({before[position : position + 40]!r} became "
            f"{after[position : position + 40]!r}); token-in-token-out needs each turn's rendering to be a "
            "prefix of the next (e.g. do not strip earlier <think> blocks or rewrite earlier turns)"
        )


@dataclass(frozen=True)
class ChatTemplate:
    """A named Jinja chat template (the Hugging Face ``chat_template`` dialect) and the stop text that
    ends an assistant turn (what the server generates last)."""

    name: str
    source: str
    end_of_turn: str = "<|im_end|>"

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """The text of ``messages`` (and ``tools``, the OpenAI ``tools`` list) under this template."""
        tpl = _ENV.from_string(self.source)
        return tpl.render(
            messages=list(messages), tools=list(tools or []), add_generation_prompt=add_generation_prompt
        )


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Hugging Face's tojson (plain json.dumps), not Jinja's HTML-escaping one: renders must agree.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_ENV.filters["tojson"] = _tojson

TINY_CHATML = ChatTemplate("tiny-chatml", TINY_CHATML_SOURCE)
QWEN_STYLE = ChatTemplate("qwen-style", QWEN_STYLE_SOURCE)
TEMPLATES = {t.name: t for t in (TINY_CHATML, QWEN_STYLE)}


def _divergence(a: str, b: str) -> int:
    """The first index where ``b`` does not continue ``a`` (``len(a)`` when ``a`` is a prefix of ``b``)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def check_append_only(
    template: ChatTemplate, messages: Sequence[Message], *, tools: Sequence[dict] | None = None
) -> None:
    """Refuse ``template`` (:class:`TemplateNotAppendOnly`) unless rendering ``messages`` grows by
    appending only, at every point a trajectory is cut: before each assistant message (its prompt,
    with the generation prompt), after it (closed), and at the end. Between two assistant messages
    the observation messages arrive together, so a template may join them (Qwen joins consecutive
    tool results into one user turn); the error's ``turn`` is the index of the message whose
    addition rewrote earlier text."""
    cuts: list[tuple[int, bool]] = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            cuts += [(i, True), (i + 1, False)]
    if not cuts or cuts[-1][0] != len(messages):
        cuts.append((len(messages), False))
    # The first cut is the opening prompt: nothing is held before it, so it starts the chain.
    prev: str | None = None
    for n, gen in cuts:
        cur = template.render(messages[:n], tools=tools, add_generation_prompt=gen)
        pos = _divergence(prev, cur) if prev is not None else 0
        if prev is not None and pos < len(prev):
            raise TemplateNotAppendOnly(template.name, max(n - 1, 0), pos, prev, cur)
        prev = cur


@dataclass(frozen=True)
class Suffix:
    """The ids appended after a generated turn: ``ids`` and, per id, its ``kinds`` (boundary: inserted
    by the template; observation: the new messages' rendering). Every one gets loss 0 and no log-prob."""

    ids: list[int]
    kinds: list[TokenKind]


def observation_suffix(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    history: Sequence[Message],
    generated_text: str,
    new_messages: Sequence[Message],
    *,
    tools: Sequence[dict] | None = None,
    stopped_on_end_of_turn: bool = True,
) -> Suffix:
    """The ids to append after the assistant turn the server just generated, to hold ``new_messages``
    and the next assistant header.

    ``history`` is the conversation before that turn, ``generated_text`` the turn's text without its
    stop string (used only to locate the template's boundary, never re-encoded into the sequence),
    ``stopped_on_end_of_turn`` whether the generated ids end with :attr:`ChatTemplate.end_of_turn`
    (False for a turn cut by the token budget: the template's closing is then a boundary inserted
    here). Raises :class:`TemplateNotAppendOnly` where the template rewrites earlier text.
    """
    turn = len(history)
    prompt = template.render(history, tools=tools, add_generation_prompt=True)
    closed = [*history, {"role": "assistant", "content": generated_text}]
    rendered = template.render(closed, tools=tools)
    head = prompt + generated_text
    pos = _divergence(head, rendered)
    if pos < len(head):
        raise TemplateNotAppendOnly(template.name, turn, pos, head, rendered)
    close = rendered[len(head) :]  # e.g. "<|im_end|>\n"
    if stopped_on_end_of_turn:
        if not close.startswith(template.end_of_turn):
            raise ValueError(
                f"template {template.name!r} closes an assistant turn with {close!r}, not with its "
                f"end_of_turn {template.end_of_turn!r}: set ChatTemplate.end_of_turn to the stop string"
            )
        close = close[len(template.end_of_turn) :]
    full = [*closed, *new_messages]
    without_gen = template.render(full, tools=tools)
    pos = _divergence(rendered, without_gen)
    if pos < len(rendered):
        raise TemplateNotAppendOnly(template.name, turn + 1, pos, rendered, without_gen)
    with_gen = template.render(full, tools=tools, add_generation_prompt=True)
    obs_text, header = without_gen[len(rendered) :], with_gen[len(without_gen) :]
    ids: list[int] = []
    kinds: list[TokenKind] = []
    for text, kind in ((close, "boundary"), (obs_text, "observation"), (header, "boundary")):
        part = tokenizer.encode(text) if text else []
        ids += part
        kinds += [kind] * len(part)
    return Suffix(ids, kinds)
