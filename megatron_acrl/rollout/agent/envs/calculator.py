"""Calculator environment: 3-digit multiplication, which a tiny model cannot do in its head, with a
calculator tool that evaluates an arithmetic expression (parsed with ``ast``; never ``eval``)."""

from __future__ import annotations

import ast
import operator
import random
from typing import Any

from megatron_acrl.rollout.agent.envs.tool_env import ToolEnv
from megatron_acrl.rollout.agent.tools import ToolRegistry
from megatron_acrl.tasks.base import Prompt
from megatron_acrl.tasks.gsm8k import extract_answer
from megatron_acrl.warmstart.agent_traces import CALCULATOR_INSTRUCTIONS

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression`` (numbers, + - * / // % **, unary signs, parentheses);
    ValueError for anything else, for division by zero and for a result too large to be useful."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {err.msg}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) > MAX_EXPONENT:
            raise ValueError(f"exponent larger than {MAX_EXPONENT}")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and b == 0:
            raise ValueError("division by zero")
        out = _BINARY[type(node.op)](a, b)
        if isinstance(out, complex) or abs(out) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return out
    raise ValueError(f"unsupported element {type(node).__name__} (numbers and + - * / // % ** only)")


def format_number(x: int | float) -> str:
    """``x`` as the calculator prints it: integers without a decimal point."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


class Calculator:
    """The calculator tool: ``{"expression": "347 * 829"}`` -> ``"287663"``."""

    name = "calculator"
    description = "Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    async def call(self, args: dict[str, Any]) -> str:
        return format_number(evaluate(args["expression"]))


def exact_reward(sample: Prompt, answer_text: str) -> float:
    """1.0 when the final number of ``answer_text`` is exactly ``sample.answer``, else 0.0."""
    return 1.0 if extract_answer(answer_text) == sample.answer else 0.0


def multiplication_prompts(n: int, seed: int = 0, digits: int = 3) -> list[Prompt]:
    """``n`` prompts "What is a * b?" with ``digits``-digit operands (deterministic in ``seed``)."""
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    out = []
    for i in range(n):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        out.append(Prompt(text=f"What is {a} * {b}?", answer=str(a * b), uid=i))
    return out


INSTRUCTIONS = CALCULATOR_INSTRUCTIONS
"""The system message (shared with the warm start's tool-call traces, which teach this format)."""


class CalculatorEnv(ToolEnv):
    """Arithmetic with a calculator tool; exact reward on the final answer."""

    name = "calculator"

    def __init__(self, *, tool_timeout_s: float, tool_output_max_bytes: int, end_on_tool_error: bool = False):
        super().__init__(
            ToolRegistry.of([Calculator()]),
            exact_reward,
            instructions=INSTRUCTIONS,
            tool_timeout_s=tool_timeout_s,
            tool_output_max_bytes=tool_output_max_bytes,
            end_on_tool_error=end_on_tool_error,
        )
