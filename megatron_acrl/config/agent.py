"""Agentic rollouts (``rollout.agent``): the agent, its environment, its limits and the sandbox's."""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

from megatron_acrl.config._base import _check, _Section

BUILTIN_ENVS = ("calculator", "python", "guess_number")
"""The environments ``megatron_acrl.rollout.agent.envs`` ships (``rollout.agent.env``)."""

_IMPORT_PATH = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def resolve_import_path(path: str) -> Any:
    """The object ``path`` (``package.module:Name``, ``Name`` may be dotted) names; ImportError or
    AttributeError with a message that says what failed."""
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _import_problem(path: str, what: str) -> str | None:
    """Why ``path`` cannot serve as ``what`` (None when it can): not ``module:Name``, the module not
    importable, the name missing, or not callable."""
    if not _IMPORT_PATH.fullmatch(path):
        return f"{path!r} is not an import path; write it as package.module:Name (e.g. mypkg.agents:MyAgent)"
    try:
        obj = resolve_import_path(path)
    except ImportError as err:
        return (
            f"cannot import {path.partition(':')[0]!r} ({err}); install the package or put its directory "
            "on PYTHONPATH"
        )
    except AttributeError:
        mod, _, name = path.partition(":")
        return f"module {mod!r} has no {name!r}; check the name after the colon"
    except Exception as err:  # the user's module raised while importing
        return f"importing {path!r} raised {type(err).__name__}: {err}"
    if not callable(obj):
        return f"{path!r} is a {type(obj).__name__}, not a {what} (a class or a function)"
    if what == "agent" and not inspect.isclass(obj) and not inspect.iscoroutinefunction(obj):
        return f"{path!r} is a plain function; an agent function must be async (async def ...)"
    if (
        what == "agent"
        and inspect.isclass(obj)
        and not inspect.iscoroutinefunction(getattr(obj, "run", None))
    ):
        return f"{path!r} is a class without an async run method; an agent class defines async def run(...)"
    if what == "agent":
        fn, args = (obj.run, (None, None, None)) if inspect.isclass(obj) else (obj, (None, None))
        try:
            inspect.signature(fn).bind(*args)
        except TypeError as err:
            return f"{path!r} cannot be called as agent(session, sample): {err}"
    return None


@dataclass(frozen=True)
class AgentConfig(_Section):
    agent: str | None = None
    """The agent, as an import path package.module:Name (an async function, or a class with an async
    run method); null: single-turn rollouts (one completion per prompt). Checked (imported) when the
    config loads, before anything starts."""

    env: str | None = None
    """The environment the agent drives: a built-in one (calculator: 3-digit multiplication with a
    calculator tool; python: the sandboxed Python tool over the task's prompts, e.g. task.name=gsm8k;
    guess_number: higher/lower hints) or an import path package.module:Name; null: none."""

    max_turns: int = 8
    """Most model turns in one trajectory; one more ends it, truncated (reason max_turns)."""

    max_trajectory_tokens: int = 2048
    """Most tokens in one trajectory (prompt, generated and observation tokens); a turn that would
    pass it ends the trajectory, truncated (reason max_tokens)."""

    tool_timeout_s: float = 30.0
    """Wall-clock limit of one tool call; past it the call ends with reason timeout."""

    tool_output_max_bytes: int = 8192
    """Longest tool result in UTF-8 bytes; a longer one is cut (reason output_too_large). Non-UTF-8
    bytes are replaced."""

    end_on_tool_error: bool = False
    """A tool failure (timeout, error, output_too_large) or a bad call ends the trajectory (true), or
    is shown to the model as the tool's result and the trajectory goes on (false). Either way it is
    recorded and counted, and the step goes on."""

    sandbox_cpu_time_s: int = 5
    """Python tool: CPU seconds of one run (RLIMIT_CPU)."""

    sandbox_memory_mb: int = 512
    """Python tool: address space of one run in MiB (RLIMIT_AS)."""

    sandbox_file_size_mb: int = 16
    """Python tool: largest file one run may write, in MiB (RLIMIT_FSIZE)."""

    sandbox_max_processes: int = 32
    """Python tool: processes and threads of one run (RLIMIT_NPROC; a fork bomb meets it)."""

    sandbox_wall_time_s: float = 10.0
    """Python tool: wall-clock seconds of one run before it is killed with its process tree."""

    def validate(self) -> list[tuple[str, str]]:
        e: list[tuple[str, str]] = []
        for name in (
            "max_turns",
            "max_trajectory_tokens",
            "tool_output_max_bytes",
            "sandbox_cpu_time_s",
            "sandbox_memory_mb",
            "sandbox_file_size_mb",
            "sandbox_max_processes",
        ):
            _check(e, getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("tool_timeout_s", "sandbox_wall_time_s"):
            _check(e, getattr(self, name) > 0, name, f"must be > 0 seconds, got {getattr(self, name)}")
        _check(
            e,
            self.env != "python" or self.tool_timeout_s >= self.sandbox_wall_time_s,
            "tool_timeout_s",
            f"{self.tool_timeout_s} s is shorter than sandbox_wall_time_s={self.sandbox_wall_time_s} s: the "
            "Python tool would time out before its sandbox's own limit; raise tool_timeout_s",
        )
        if self.agent is not None:
            problem = _import_problem(self.agent, "agent")
            _check(e, problem is None, "agent", f"{problem}")
        if self.env is not None and self.env not in BUILTIN_ENVS:
            if ":" in self.env:
                problem = _import_problem(self.env, "environment")
                _check(e, problem is None, "env", f"{problem}")
            else:
                _check(
                    e,
                    False,
                    "env",
                    f"unknown environment {self.env!r}; choose one of {', '.join(BUILTIN_ENVS)} or give an "
                    "import path package.module:Name",
                )
        return e
