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
    """Read a GSM8K-format JSONL file; every error (not a file, not UTF-8, a line that is not a JSON
    object, a missing field, an answer without a number, no rows) names the file and line and the fix."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{p} is a directory; task.data_path must be a JSONL file (one JSON object a line)")
    if not p.is_file():
        raise FileNotFoundError(f"task.data_path: no such file {p}")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        line = p.read_bytes()[: err.start].count(b"\n") + 1
        raise ValueError(
            f"{p}:{line}: not UTF-8 text (byte {err.object[err.start]:#04x}); re-encode the file"
        ) from None
    prompts = [row for i, line in enumerate(text.splitlines(), 1) if (row := _parse_row(p, i, line))]
    if not prompts:
        raise ValueError(f"{p}: no examples (the file is empty); GSM8K format: one JSON object a line")
    return prompts


def _parse_row(p: Path, i: int, line: str) -> Prompt | None:
    """Line ``i`` of ``p`` as a prompt (None: a blank line)."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{p}:{i}: not valid JSON ({err.msg}, column {err.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(
            f"{p}:{i}: expected a JSON object with 'question' and 'answer', "
            f"got a {type(row).__name__} ({line[:40]!r})"
        )
    for key in ("question", "answer"):
        if key not in row:
            raise ValueError(f"{p}:{i}: missing field {key!r} (GSM8K format: question, answer)")
    gold = extract_answer(str(row["answer"]))
    if gold is None:
        raise ValueError(f"{p}:{i}: answer has no number (expected '#### <number>')")
    return Prompt(text=str(row["question"]), answer=gold, uid=i)


class GSM8KTask:
    """Math word problems from a JSONL file; the last ``eval_size`` rows are held out."""

    name = "gsm8k"

    def __init__(self, data_path: str | Path, eval_size: int = 64):
        rows = load_jsonl(data_path)
        k = min(eval_size, len(rows) // 2)
        self._train, self._eval = rows[: len(rows) - k], rows[len(rows) - k :]

    @property
    def num_train_prompts(self) -> int:
        """Training rows (one epoch of :meth:`train_prompts`)."""
        return len(self._train)

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        return cycle_shuffled(self._train, seed)

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self._eval[:n]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if extract_answer(completion) == prompt.answer else 0.0
