"""Agents and envs the config tests name by import path (``sample_agents:Name``)."""

from __future__ import annotations

from megatron_acrl.rollout.agent.env import Step

NOT_CALLABLE = 3


class GoodAgent:
    async def run(self, session, sample):  # noqa: ANN001 - the agent loop's shape is not built yet
        return None


async def good_agent_fn(session, sample):  # noqa: ANN001
    return None


def sync_agent_fn(session, sample):  # noqa: ANN001
    return None


class NoRun:
    pass


class NeverDone:
    name = "never_done"

    async def reset(self, sample):  # noqa: ANN001
        return [{"role": "user", "content": sample.text}]

    async def step(self, action_text: str) -> Step:
        return Step([{"role": "user", "content": "again"}], 0.0, False)


class RaisingAgent:
    async def run(self, session, sample):  # noqa: ANN001
        await session.generate([{"role": "user", "content": sample.text}])
        raise RuntimeError("the agent's own bug")


async def one_arg_agent(session):  # noqa: ANN001
    return 0.0
