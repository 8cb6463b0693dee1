"""Tasks with verifiable rewards: synthetic (addition, counting, sorting) and GSM8K-format JSONL."""

from __future__ import annotations

from megatron_acrl.config import TaskConfig
from megatron_acrl.tasks.base import Prompt, Task
from megatron_acrl.tasks.gsm8k import GSM8KTask, extract_answer
from megatron_acrl.tasks.synthetic import AdditionTask, CountingTask, SortingTask

SYNTHETIC = {"addition": AdditionTask, "counting": CountingTask, "sorting": SortingTask}


def make_task(cfg: TaskConfig) -> Task:
    """Build the task named by ``cfg.name``."""
    if cfg.name in SYNTHETIC:
        return SYNTHETIC[cfg.name](cfg.num_digits, heldout_fraction=cfg.heldout_fraction)
    if cfg.name == "gsm8k":
        if cfg.data_path is None:
            raise ValueError("task.name=gsm8k needs task.data_path (a GSM8K-format JSONL file)")
        return GSM8KTask(cfg.data_path, cfg.eval_size)
    raise ValueError(f"task.name: unknown task {cfg.name!r}; choose one of {sorted(SYNTHETIC) + ['gsm8k']}")


__all__ = [
    "AdditionTask",
    "CountingTask",
    "GSM8KTask",
    "Prompt",
    "SortingTask",
    "Task",
    "extract_answer",
    "make_task",
]
