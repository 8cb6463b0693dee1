"""Tools: the call-markup parser, the small schema check and the guarded call's limits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from megatron_acrl.rollout.agent.tools import (
    ToolCall,
    ToolParseError,
    ToolRegistry,
    call_tool,
    cap_text,
    format_tool_call,
    parse_tool_calls,
    schema_errors,
)


class Echo:
    name = "echo"
    description = "echo"
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["text"],
        "additionalProperties": False,
    }

    def __init__(self, behaviour: str = "echo"):
        self.behaviour = behaviour

    async def call(self, args: dict[str, Any]) -> Any:
        if self.behaviour == "hang":
            await asyncio.sleep(3600)
        if self.behaviour == "raise":
            raise RuntimeError("boom")
        if self.behaviour == "bytes":
            return b"ok \xff\xfe end"
        if self.behaviour == "none":
            return None
        return args["text"] * args.get("n", 1)


REG = ToolRegistry.of([Echo()])


def test_parses_calls_and_answers():
    text = 'sure <tool_call>{"name": "echo", "arguments": {"text": "a", "n": 2}}</tool_call>'
    assert parse_tool_calls(text, REG) == [ToolCall("echo", {"text": "a", "n": 2})]
    two = text + '\n<tool_call>\n{"name": "echo", "arguments": "{\\"text\\": \\"b\\"}"}\n</tool_call>'
    assert parse_tool_calls(two, REG) == [
        ToolCall("echo", {"text": "a", "n": 2}),
        ToolCall("echo", {"text": "b"}),
    ]
    assert parse_tool_calls("The answer is 12.", REG) == []
    call = ToolCall("echo", {"text": "x"})
    assert parse_tool_calls(format_tool_call(call), REG) == [call]


@pytest.mark.parametrize(
    "text,kind",
    [
        ("<tool_call>{not json}</tool_call>", "malformed"),
        ('<tool_call>{"name": "echo", "arguments": {"text": "a"}}', "malformed"),  # cut mid-call
        ("x</tool_call>", "malformed"),
        ('<tool_call>["echo"]</tool_call>', "malformed"),
        ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "unknown_tool"),
        ('<tool_call>{"name": "echo", "arguments": {}}</tool_call>', "bad_arguments"),
        ('<tool_call>{"name": "echo", "arguments": {"text": 3}}</tool_call>', "bad_arguments"),
        ('<tool_call>{"name": "echo", "arguments": {"text": "a", "x": 1}}</tool_call>', "bad_arguments"),
        ('<tool_call>{"name": "echo", "arguments": [1]}</tool_call>', "bad_arguments"),
    ],
)
def test_bad_calls_are_typed_errors(text, kind):
    got = parse_tool_calls(text, REG)
    assert isinstance(got, ToolParseError) and got.kind == kind, got


def test_schema_check():
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "xs": {"type": "array", "items": {"type": "number"}}},
    }
    assert schema_errors({"n": 1, "xs": [1, 2.5]}, schema) == []
    assert schema_errors({"n": True}, schema)  # a bool is not an integer
    assert schema_errors({"xs": [1, "a"]}, schema) == ["arguments.xs[1]: expected number, got str 'a'"]
    assert schema_errors("a", {"type": "string", "enum": ["b"]})


def test_registry_refuses_a_name_twice():
    with pytest.raises(ValueError, match="registered twice"):
        ToolRegistry.of([Echo(), Echo()])
    assert REG.schemas()[0]["function"]["name"] == "echo"


def run(coro):
    return asyncio.run(coro)


def test_call_tool_limits():
    ok = run(call_tool(Echo(), {"text": "ab"}, timeout_s=5, max_output_bytes=100))
    assert (ok.text, ok.failure) == ("ab", None)
    hang = run(call_tool(Echo("hang"), {"text": "a"}, timeout_s=0.05, max_output_bytes=100))
    assert hang.failure == "timeout" and "timed out" in hang.text
    err = run(call_tool(Echo("raise"), {"text": "a"}, timeout_s=5, max_output_bytes=100))
    assert err.failure == "error" and "RuntimeError: boom" in err.text
    big = run(call_tool(Echo(), {"text": "x", "n": 10_000}, timeout_s=5, max_output_bytes=100))
    assert big.failure == "output_too_large" and len(big.text.encode()) == 100
    raw = run(call_tool(Echo("bytes"), {"text": "a"}, timeout_s=5, max_output_bytes=100))
    assert raw.failure is None and raw.text == "ok \ufffd\ufffd end"
    none = run(call_tool(Echo("none"), {"text": "a"}, timeout_s=5, max_output_bytes=100))
    assert none.failure == "error"


def test_cap_text_never_splits_a_character():
    text, cut = cap_text("é" * 10, 5)  # 2 bytes each
    assert cut and text == "éé" and len(text.encode()) <= 5
    assert cap_text("abc", 3) == ("abc", False)
    # Each invalid byte becomes U+FFFD (3 bytes): still within the cap.
    text, cut = cap_text(b"\xff" * 4, 6)
    assert cut and text == "\ufffd\ufffd"
