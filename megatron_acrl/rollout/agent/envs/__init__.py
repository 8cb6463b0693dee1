"""The built-in environments (``rollout.agent.env``) and the factory that builds one from the config."""

from __future__ import annotations

from megatron_acrl.config import BUILTIN_ENVS, AgentConfig, resolve_import_path
from megatron_acrl.rollout.agent.env import Env, TurnLimit
from megatron_acrl.rollout.agent.envs.calculator import Calculator, CalculatorEnv, multiplication_prompts
from megatron_acrl.rollout.agent.envs.guess_number import GuessNumberEnv, guess_prompts
from megatron_acrl.rollout.agent.envs.python_tool import PythonEnv, PythonTool
from megatron_acrl.rollout.agent.envs.tool_env import RewardFn, ToolEnv
from megatron_acrl.tasks.base import Task

ENV_NAMES = ("calculator", "python", "guess_number")
assert ENV_NAMES == BUILTIN_ENVS, "megatron_acrl.config.agent.BUILTIN_ENVS must list these envs"


def make_env(cfg: AgentConfig, task: Task | None = None) -> Env:
    """A fresh environment for one episode at a time, wrapped in ``cfg.max_turns``. The python env
    scores with ``task``'s reward (GSM8K-format data: ``task.name=gsm8k``) when one is given. The
    Python sandbox is checked here: a machine that cannot sandbox fails before any rollout."""
    env: Env
    limits = {
        "tool_timeout_s": cfg.tool_timeout_s,
        "tool_output_max_bytes": cfg.tool_output_max_bytes,
        "end_on_tool_error": cfg.end_on_tool_error,
    }
    if cfg.env == "calculator":
        env = CalculatorEnv(**limits)
    elif cfg.env == "python":
        from megatron_acrl.rollout.agent.sandbox import Sandbox, SandboxLimits

        sandbox = Sandbox(
            SandboxLimits(
                cpu_time_s=cfg.sandbox_cpu_time_s,
                memory_mb=cfg.sandbox_memory_mb,
                file_size_mb=cfg.sandbox_file_size_mb,
                max_processes=cfg.sandbox_max_processes,
                wall_time_s=cfg.sandbox_wall_time_s,
                max_output_bytes=cfg.tool_output_max_bytes,
            )
        )
        reward: RewardFn | None = task.reward if task is not None else None
        env = PythonEnv(sandbox, **({"reward_fn": reward} if reward else {}), **limits)
    elif cfg.env == "guess_number":
        env = GuessNumberEnv()
    elif cfg.env is not None:
        env = resolve_import_path(cfg.env)()
    else:
        raise ValueError("rollout.agent.env is null: there is no environment to build")
    return TurnLimit(env, cfg.max_turns)


__all__ = [
    "ENV_NAMES",
    "Calculator",
    "CalculatorEnv",
    "GuessNumberEnv",
    "PythonEnv",
    "PythonTool",
    "ToolEnv",
    "guess_prompts",
    "make_env",
    "multiplication_prompts",
]
