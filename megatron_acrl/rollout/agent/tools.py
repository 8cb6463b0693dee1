"""Tools an agent calls: the interface, a registry by name, the parser of tool-call markup in the
model's output, and the guarded call that applies the limits.

Tool calls use the markup of our chat templates (as Qwen and Hermes do)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 829"}}</tool_call>

:func:`parse_tool_calls` returns the calls of one assistant message, or a :class:`ToolParseError`
(malformed markup, unknown tool, arguments that do not match the tool's JSON schema). A result is
text; :func:`call_tool` applies the limits (timeout, output-size cap, non-UTF-8 bytes replaced) and
records why a call did not give a normal result (:data:`ToolFailure`), so the agent can end that one
trajectory, never the step.

No torch or transformers here: this module is pure Python.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
"""One call's markup; group 1 is its JSON body."""
_CALL_RE = TOOL_CALL_RE

ParseErrorKind = Literal["malformed", "unknown_tool", "bad_arguments"]
"""Why a tool call could not be parsed: markup or JSON that does not parse, a name no tool in the
registry has, arguments that do not match the tool's schema."""

ToolFailure = Literal["timeout", "error", "output_too_large", "bad_call"]
"""Why a call gave no normal result: it ran past its timeout, raised, printed more than the cap (the
result is cut and still returned), or the model's call could not be parsed (:class:`ToolParseError`)."""


@runtime_checkable
class Tool(Protocol):
    """A tool: a name, the JSON schema of its arguments (an ``object`` schema with ``properties`` and
    ``required``) and an async call that returns text. Limits are applied by :func:`call_tool`, not
    by the tool."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    async def call(self, args: dict[str, Any]) -> str: ...


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its (schema-checked) arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolParseError:
    """A call in the model's output that cannot be run; ``index`` is the call's position (0-based)
    in the message, ``message`` says what is wrong in words the model could read back."""

    kind: ParseErrorKind
    message: str
    index: int = 0


@dataclass(frozen=True)
class ToolResult:
    """What a call gave: ``text`` (always valid UTF-8, at most the cap) and ``failure`` (None when the
    tool returned normally within its limits)."""

    text: str
    failure: ToolFailure | None = None


@dataclass
class ToolRegistry:
    """Tools by name."""

    tools: dict[str, Tool] = field(default_factory=dict)

    @classmethod
    def of(cls, tools: Iterable[Tool]) -> ToolRegistry:
        """A registry of ``tools``; two tools of one name are refused."""
        reg = cls()
        for t in tools:
            reg.add(t)
        return reg

    def add(self, tool: Tool) -> None:
        """Register ``tool``; a name already taken is a ValueError."""
        if tool.name in self.tools:
            raise ValueError(f"tool {tool.name!r} is registered twice; give each tool its own name")
        self.tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self.tools.get(name)

    def names(self) -> list[str]:
        return sorted(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The tools in the OpenAI/Qwen ``tools`` format (what a chat template renders)."""
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)},
            }
            for t in (self.tools[n] for n in self.names())
        ]


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def schema_errors(value: Any, schema: Mapping[str, Any], path: str = "arguments") -> list[str]:
    """The ways ``value`` fails ``schema`` (a small JSON-schema subset: ``type`` (one or a list),
    ``properties``, ``required``, ``additionalProperties: false``, ``items``, ``enum``); [] if it fits."""
    errors: list[str] = []
    want = schema.get("type")
    if want is not None:
        kinds = [want] if isinstance(want, str) else list(want)
        ok = any(
            isinstance(value, _JSON_TYPES.get(k, ()))
            and not (k in ("integer", "number") and isinstance(value, bool))
            for k in kinds
        )
        if not ok:
            return [f"{path}: expected {' or '.join(kinds)}, got {type(value).__name__} {value!r:.40}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: must be one of {list(schema['enum'])}, got {value!r:.40}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{path}: missing required key {key!r}")
        for key, sub in value.items():
            if key in props:
                errors += schema_errors(sub, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unknown key {key!r} (allowed: {sorted(props)})")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    return errors


def _parse_one(body: str, index: int, registry: ToolRegistry) -> ToolCall | ToolParseError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolParseError("malformed", f"tool call {index}: not valid JSON ({err.msg})", index)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolParseError(
            "malformed", f'tool call {index}: expected {{"name": ..., "arguments": {{...}}}}', index
        )
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolParseError("malformed", f"tool call {index}: arguments are not JSON", index)
    if not isinstance(args, dict):
        return ToolParseError("bad_arguments", f"tool call {index}: arguments must be an object", index)
    tool = registry.get(obj["name"])
    if tool is None:
        return ToolParseError(
            "unknown_tool", f"tool call {index}: no tool {obj['name']!r} (tools: {registry.names()})", index
        )
    errs = schema_errors(args, tool.parameters)
    if errs:
        return ToolParseError("bad_arguments", f"tool call {index} ({tool.name}): " + "; ".join(errs), index)
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str, registry: ToolRegistry) -> list[ToolCall] | ToolParseError:
    """The tool calls in one assistant message ``text`` ([] when it has none: a final answer), or the
    first :class:`ToolParseError`. An opening tag without its closing tag (or the reverse) is
    malformed: generation stopped inside a call, or the model mixed up the markup."""
    calls: list[ToolCall] = []
    for i, m in enumerate(_CALL_RE.finditer(text)):
        got = _parse_one(m.group(1).strip(), i, registry)
        if isinstance(got, ToolParseError):
            return got
        calls.append(got)
    rest = _CALL_RE.sub("", text)
    if TOOL_CALL_OPEN in rest or TOOL_CALL_CLOSE in rest:
        tag = TOOL_CALL_OPEN if TOOL_CALL_OPEN in rest else TOOL_CALL_CLOSE
        return ToolParseError(
            "malformed", f"unbalanced {tag} (every call is <tool_call>{{...}}</tool_call>)", len(calls)
        )
    return calls


def format_tool_call(call: ToolCall) -> str:
    """``call`` in the markup :func:`parse_tool_calls` reads (for warm-start traces and tests)."""
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': call.name, 'arguments': call.arguments})}{TOOL_CALL_CLOSE}"


def cap_text(data: str | bytes, max_bytes: int) -> tuple[str, bool]:
    """``data`` as valid UTF-8 text of at most ``max_bytes`` bytes (invalid bytes replaced by U+FFFD,
    a cut never splits a character); the flag says whether it was cut."""
    raw = data.encode("utf-8", errors="replace") if isinstance(data, str) else data
    if len(raw) <= max_bytes:
        text = raw.decode("utf-8", errors="replace")
        if len(text.encode("utf-8")) <= max_bytes:
            return text, False
    k = min(max_bytes, len(raw))
    # Back off over continuation bytes (0b10xxxxxx) so the cut never splits a character.
    while 0 < k < len(raw) and max_bytes - k < 3 and (raw[k] & 0xC0) == 0x80:
        k -= 1
    text = raw[:k].decode("utf-8", errors="replace")
    while len(text.encode("utf-8")) > max_bytes:  # each replaced byte became 3 bytes of U+FFFD
        text = text[:-1]
    return text, True


async def call_tool(
    tool: Tool, args: dict[str, Any], *, timeout_s: float, max_output_bytes: int
) -> ToolResult:
    """Run ``tool`` on ``args`` under the limits: a call that runs past ``timeout_s`` is cancelled
    (``timeout``), one that raises gives its exception's type and message (``error``), a result longer
    than ``max_output_bytes`` is cut to it (``output_too_large``). Never raises (but re-raises
    cancellation of the caller itself)."""
    try:
        out = await asyncio.wait_for(tool.call(args), timeout=timeout_s)
    except TimeoutError:
        return ToolResult(f"error: tool {tool.name} timed out after {timeout_s:g} s", "timeout")
    except asyncio.CancelledError:
        raise
    except Exception as err:  # a tool's bug ends its trajectory, never the step
        text, _ = cap_text(f"error: {type(err).__name__}: {err}", max_output_bytes)
        return ToolResult(text, "error")
    if not isinstance(out, str | bytes):
        return ToolResult(f"error: tool {tool.name} returned {type(out).__name__}, not text", "error")
    text, cut = cap_text(out, max_output_bytes)
    return ToolResult(text, "output_too_large" if cut else None)
