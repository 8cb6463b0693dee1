"""Chat templates: both shipped ones are append-only over multi-turn tool conversations and agree
with Hugging Face's rendering; a template that rewrites earlier turns is refused, naming the turn;
observations are tokenized as a suffix whose ids extend the trajectory exactly."""

from __future__ import annotations

import pytest

from megatron_acrl.rollout.agent.templates import (
    QWEN_STYLE,
    TEMPLATES,
    TINY_CHATML,
    ChatTemplate,
    HFTokenizer,
    TemplateNotAppendOnly,
    check_append_only,
    observation_suffix,
)
from megatron_acrl.rollout.agent.tools import ToolRegistry

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "math", "parameters": {}}}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 829"}}</tool_call>'
CONVERSATION = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 347 * 829?"},
    {"role": "assistant", "content": "<think>big</think>" + CALL},
    {"role": "tool", "content": "287663"},
    {"role": "assistant", "content": CALL + CALL},
    {"role": "tool", "content": "287663"},
    {"role": "tool", "content": "287663"},
    {"role": "assistant", "content": "The answer is 287663."},
    {"role": "user", "content": "thanks; again?"},
    {"role": "assistant", "content": "287663"},
]

# Qwen3-like: the <think> block of every assistant turn but the last is stripped.
STRIPPING = ChatTemplate(
    "strips-think",
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_acrl.warmstart.tiny_model import build_tokenizer

    return AutoTokenizer.from_pretrained(str(build_tokenizer(320, cache_dir=tmp_path_factory.mktemp("tok"))))


@pytest.mark.parametrize("template", list(TEMPLATES.values()), ids=list(TEMPLATES))
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_shipped_templates_are_append_only(template, tools):
    check_append_only(template, CONVERSATION, tools=tools)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    with pytest.raises(TemplateNotAppendOnly, match="adding message 3") as err:
        check_append_only(STRIPPING, CONVERSATION)
    assert err.value.turn == 3
    before = STRIPPING.render(CONVERSATION[:3])
    # The divergence is inside the stripped block ("<think>" became "<tool_call>": "<t" is shared).
    assert before[: err.value.position].endswith("assistant\n<t")


@pytest.mark.parametrize("template", [TINY_CHATML, QWEN_STYLE], ids=["tiny", "qwen"])
def test_rendering_matches_hugging_face(template, tokenizer):
    for tools in (None, TOOLS):
        for gen in (False, True):
            msgs = [
                *CONVERSATION[:3],
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"name": "calculator", "arguments": {"expression": "1 < 2"}}],
                },
            ]
            want = tokenizer.apply_chat_template(
                msgs, tools=tools, tokenize=False, add_generation_prompt=gen, chat_template=template.source
            )
            assert template.render(msgs, tools=tools, add_generation_prompt=gen) == want


def test_tiny_tokenizer_template():
    from megatron_acrl.warmstart.tiny_model import CHAT_TEMPLATE

    assert CHAT_TEMPLATE == TINY_CHATML.source
    # Plain messages render exactly as the tokenizer's first template did.
    msgs = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    want = "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n<|im_start|>assistant\n"
    assert TINY_CHATML.render(msgs, add_generation_prompt=True) == want


@pytest.mark.parametrize("template", [TINY_CHATML, QWEN_STYLE], ids=["tiny", "qwen"])
def test_observation_suffix_extends_the_trajectory_exactly(template, tokenizer):
    """Token-in-token-out over three turns: prompt ids + generated ids + suffix ids + ... equals the
    tokenization of the whole rendered conversation (the generated ids here are the tokenizer's
    own ids of the text, standing in for the server's)."""
    tok = HFTokenizer(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    history = CONVERSATION[:2]
    ids = tok.encode(template.render(history, tools=TOOLS, add_generation_prompt=True))
    kinds = ["prompt"] * len(ids)
    turns = [(CONVERSATION[2]["content"], CONVERSATION[3:4]), (CONVERSATION[4]["content"], CONVERSATION[5:7])]
    for text, obs in turns:
        generated = tok.encode(text) + [end]
        ids += generated
        kinds += ["generated"] * len(generated)
        suffix = observation_suffix(template, tok, history, text, obs, tools=TOOLS)
        ids += suffix.ids
        kinds += suffix.kinds
        history = [*history, {"role": "assistant", "content": text}, *obs]
    assert ids == tok.encode(template.render(history, tools=TOOLS, add_generation_prompt=True))
    # The "\n" after each generated <|im_end|> and each assistant header are boundary tokens.
    nl = tok.encode("\n")
    header = tok.encode("<|im_start|>assistant\n")
    assert kinds.count("boundary") == 2 * (len(nl) + len(header))
    assert {k for k in kinds} == {"prompt", "generated", "boundary", "observation"}


def test_a_truncated_turn_gets_its_closing_as_boundary(tokenizer):
    tok = HFTokenizer(tokenizer)
    history = CONVERSATION[:2]
    suffix = observation_suffix(
        TINY_CHATML,
        tok,
        history,
        "cut in the mid",
        [{"role": "user", "content": "go on"}],
        stopped_on_end_of_turn=False,
    )
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert suffix.ids[0] == end and suffix.kinds[0] == "boundary"


def test_suffix_refuses_a_template_that_rewrites(tokenizer):
    with pytest.raises(TemplateNotAppendOnly):
        observation_suffix(
            STRIPPING,
            HFTokenizer(tokenizer),
            CONVERSATION[:2],
            "<think>x</think>y",
            [{"role": "user", "content": "z"}],
        )


def test_registry_schemas_render():
    reg = ToolRegistry.of([])
    check_append_only(QWEN_STYLE, CONVERSATION, tools=reg.schemas() or None)
