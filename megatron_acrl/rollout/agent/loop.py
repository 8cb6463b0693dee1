"""The agent interface and the loop that runs one trajectory, faults included.

An agent is what a user writes: an async function, or a class (built with no arguments) with an
async ``run`` method, taking ``(session, sample)`` and returning the trajectory's reward (a float),
or ``(reward, reason)``. It talks in messages and text only (:class:`AgentSession`; ``session.env``
is the configured environment, or None); the session does the token bookkeeping::

    async def my_agent(session, sample):
        text = await session.generate([{"role": "user", "content": sample.text}])
        return float(text.strip() == sample.answer)

It is chosen with ``rollout.agent.agent: mypkg.module:my_agent``; with ``agent`` null and
``rollout.agent.env`` set, the built-in :func:`env_agent` drives the environment (the tool-calling
envs parse the model's tool calls with their :class:`~megatron_acrl.rollout.agent.tools.ToolRegistry`).

:func:`run_trajectory` never raises for a trajectory's own fault: a limit (:class:`TrajectoryEnd`),
an agent or env that raises, a tool that fails end that trajectory with a recorded reason and
reward 0 (or the reward the env gave so far); the step goes on. Only the servers' errors
(``ServerGoneError``, ``TimeoutError`` of a request) propagate, for the rollout's retry. However it
ends, the session is closed: its affinity pin is dropped (a regenerated trajectory has a new key).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from megatron_acrl.rollout.agent.session import AgentSession, Trajectory, TrajectoryEnd
from megatron_acrl.tasks.base import Prompt

AgentFn = Callable[[AgentSession, Prompt], Awaitable[Any]]


def agent_signature_problem(obj: Any) -> str | None:
    """Why ``obj`` cannot be called as ``agent(session, sample)`` (None when it can)."""
    fn = obj.run if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(fn)
        if inspect.isclass(obj):
            sig.bind(None, None, None)  # self, session, sample
        else:
            sig.bind(None, None)
    except (TypeError, ValueError) as err:
        return f"an agent is called as agent(session, sample); {getattr(obj, '__name__', obj)!r} {err}"
    return None


def load_agent(obj: Any) -> AgentFn:
    """The agent callable from the resolved ``rollout.agent.agent`` (a function or a class)."""
    problem = agent_signature_problem(obj)
    if problem is not None:
        raise TypeError(problem)
    if inspect.isclass(obj):
        return obj().run  # type: ignore[no-any-return]
    return obj  # type: ignore[no-any-return]


async def env_agent(session: AgentSession, sample: Prompt) -> tuple[float, str]:
    """The built-in multi-turn agent: reset ``session.env`` on the sample, then generate a turn and
    step the env with it until the env says done. Returns (sum of the turns' rewards, end reason)."""
    env = session.env
    if env is None:
        raise ValueError("env_agent needs rollout.agent.env")
    observation = await env.reset(sample)
    total = 0.0
    while True:
        try:
            text = await session.generate(observation)
        except TrajectoryEnd as end:
            end.reward = total
            raise
        step = await session.step_env(env, text)
        total += float(step.reward)
        if step.done:
            return total, str(step.reason or "answered")
        observation = step.observation


async def run_trajectory(agent: AgentFn, session: AgentSession, sample: Prompt) -> Trajectory:
    """Run ``agent`` on ``sample`` in ``session``; the trajectory with its reward and end reason
    (module doc: a trajectory's fault ends it, recorded; the servers' errors propagate)."""
    from sglang_bridge.transport import ServerGoneError

    traj = session.traj
    try:
        result = await agent(session, sample)
        reward, reason = result if isinstance(result, tuple) else (result, "answered")
        traj.reward, traj.reason = float(reward), str(reason)
    except TrajectoryEnd as end:
        traj.reward, traj.reason = end.reward, end.reason
    except (ServerGoneError, TimeoutError):
        raise
    except Exception as err:  # noqa: BLE001 - an agent or env fault ends only its trajectory
        traj.reward, traj.reason = 0.0, "agent_error"
        traj.texts.append(f"[agent error] {type(err).__name__}: {err}")
    finally:  # also on a server's error and on cancellation: no turn of it follows
        session.close()
    return traj
