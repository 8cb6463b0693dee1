"""``rollout.agent``: typed fields, validated up front, import paths checked before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_acrl.config import AgentConfig, ConfigError, explain, load_config

HERE = str(Path(__file__).parent)


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    monkeypatch.syspath_prepend(HERE)


def test_defaults_are_single_turn():
    cfg = load_config(None)
    assert cfg.rollout.agent == AgentConfig() and cfg.rollout.agent.agent is None


def test_overrides_and_explain():
    cfg = load_config(
        None,
        [
            "rollout.agent.agent=sample_agents:GoodAgent",
            "rollout.agent.env=guess_number",
            "rollout.agent.max_turns=5",
        ],
    )
    assert (cfg.rollout.agent.agent, cfg.rollout.agent.env, cfg.rollout.agent.max_turns) == (
        "sample_agents:GoodAgent",
        "guess_number",
        5,
    )
    load_config(None, ["rollout.agent.agent=sample_agents:good_agent_fn"])
    text = "\n".join(explain())
    for name in (
        "agent",
        "env",
        "max_turns",
        "max_trajectory_tokens",
        "tool_timeout_s",
        "tool_output_max_bytes",
        "sandbox_cpu_time_s",
        "sandbox_memory_mb",
        "sandbox_wall_time_s",
    ):
        assert f"rollout.agent.{name}:" in text


@pytest.mark.parametrize(
    "value,msg",
    [
        ("not a path", "not an import path"),
        ("no_such_pkg_xyz.mod:Agent", "cannot import 'no_such_pkg_xyz.mod'"),
        ("sample_agents:Missing", "has no 'Missing'"),
        ("sample_agents:NOT_CALLABLE", "not a agent"),
        ("sample_agents:sync_agent_fn", "must be async"),
        ("sample_agents:NoRun", "without an async run"),
    ],
)
def test_bad_agent_paths_are_refused_naming_them(value, msg):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"rollout.agent.agent={value}"])
    assert "rollout.agent.agent" in str(err.value) and msg in str(err.value)


def test_env_and_limits_are_checked():
    with pytest.raises(ConfigError, match="unknown environment 'calc'"):
        load_config(None, ["rollout.agent.env=calc"])
    with pytest.raises(ConfigError, match="rollout.agent.env: cannot import"):
        load_config(None, ["rollout.agent.env=nope_xyz:Env"])
    load_config(None, ["rollout.agent.env=sample_agents:NeverDone"])
    with pytest.raises(ConfigError, match="rollout.agent.max_turns: must be >= 1"):
        load_config(None, ["rollout.agent.max_turns=0"])
    with pytest.raises(ConfigError, match="rollout.agent.tool_timeout_s"):
        load_config(None, ["rollout.agent.env=python", "rollout.agent.tool_timeout_s=1"])
    with pytest.raises(ConfigError, match="did you mean 'rollout.agent.max_turns'"):
        load_config(None, ["rollout.agent.max_turn=3"])
