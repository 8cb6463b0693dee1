"""GSM8K-format JSONL tasks and a math answer checker (no download: the data path is configured).

Each line is ``{"question": str, "answer": str}`` where the answer ends with ``#### <number>`` (the
GSM8K convention); a plain number is accepted too. Completions are scored by extracting the final
answer: ``#### x``, then ``\\boxed{x}``, then "answer is x", then the last number in the text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from megatron_acrl.tasks.base import Prompt, cycle_shuffled

_NUMBER = r"-?[\d,]*\.?\d+"
_PATTERNS = (
    re.compile(r"####\s*(" + _NUMBER + ")"),
    re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}"),
    re.compile(r"answer is\s*:?\s*\$?(" + _NUMBER + ")", re.IGNORECASE),
)
_ANY_NUMBER = re.compile(_NUMBER)


def normalize_number(text: str) -> str | None:
    """``"1,234.50"`` -> ``"1234.5"``; None if it is not a number."""
    t = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = float(t)
    except ValueError:
        return None
    return str(int(value)) if value == int(value) else repr(value)


def extract_answer(completion: str) -> str | None:
    """Final numeric answer of a completion, normalised; None if there is none."""
    for pat in _PATTERNS:
        found = pat.findall(completion)
        if found:
            return normalize_number(found[-1])
    nums = _ANY_NUMBER.findall(completion)
    return normalize_number(nums[-1]) if nums else None


def load_jsonl(path: str | Path) -> list[Prompt]:
    """Read a GSM8K-format JSONL file; errors name the file, line and missing field."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"task.data_path: no such file {p}")
    prompts = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{p}:{i}: not valid JSON ({err.msg})") from None
        for key in ("question", "answer"):
            if key not in row:
                raise ValueError(f"{p}:{i}: missing field {key!r} (GSM8K format: question, answer)")
        gold = extract_answer(str(row["answer"]))
        if gold is None:
            raise ValueError(f"{p}:{i}: answer has no number (expected '#### <number>')")
        prompts.append(Prompt(text=str(row["question"]), answer=gold, uid=i))
    if not prompts:
        raise ValueError(f"{p}: no examples")
    return prompts


class GSM8KTask:
    """Math word problems from a JSONL file; the last ``eval_size`` rows are held out."""

    name = "gsm8k"

    def __init__(self, data_path: str | Path, eval_size: int = 64):
        rows = load_jsonl(data_path)
        k = min(eval_size, len(rows) // 2)
        self._train, self._eval = rows[: len(rows) - k], rows[len(rows) - k :]

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        return cycle_shuffled(self._train, seed)

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self._eval[:n]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if extract_answer(completion) == prompt.answer else 0.0
