"""Tasks: deterministic streams, disjoint eval splits, reward checkers, GSM8K loader errors."""

from __future__ import annotations

import itertools
import json

import pytest

from megatron_acrl.config import TaskConfig
from megatron_acrl.tasks import GSM8KTask, extract_answer, make_task


@pytest.mark.parametrize("name", ["addition", "counting", "sorting"])
def test_synthetic_tasks(name):
    task = make_task(TaskConfig(name=name))
    a = list(itertools.islice(task.train_prompts(seed=1), 50))
    b = list(itertools.islice(task.train_prompts(seed=1), 50))
    assert a == b
    assert a != list(itertools.islice(task.train_prompts(seed=2), 50))
    evals = task.eval_prompts(100)
    assert len(evals) == 100
    train_texts = {p.text for p in itertools.islice(task.train_prompts(seed=0), 5000)}
    assert not train_texts & {p.text for p in evals}
    p = a[0]
    assert task.reward(p, p.answer) == 1.0
    assert task.reward(p, "nothing") == 0.0


def test_addition_reward_reads_the_first_number():
    task = make_task(TaskConfig(name="addition"))
    p = next(task.train_prompts(0))
    assert task.reward(p, f"{p.answer}<|endoftext|>junk 99") == 1.0
    assert task.reward(p, f"{int(p.answer) + 1}") == 0.0


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("... #### 1,234", "1234"),
        ("so \\boxed{42}.", "42"),
        ("The answer is: 7.", "7"),
        ("3 then 5", "5"),
        ("x = 2.50", "2.5"),
        ("none", None),
    ],
)
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_gsm8k_loader(tmp_path):
    path = tmp_path / "gsm.jsonl"
    rows = [{"question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = GSM8KTask(path, eval_size=3)
    assert len(task.eval_prompts(10)) == 3
    p = task.eval_prompts(1)[0]
    assert task.reward(p, f"I think #### {p.answer}") == 1.0
    assert task.reward(p, "#### 0") == 0.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: missing field 'answer'"):
        GSM8KTask(bad)
    with pytest.raises(FileNotFoundError, match="task.data_path"):
        GSM8KTask(tmp_path / "none.jsonl")
