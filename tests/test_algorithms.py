"""The algorithm table (issue 32): each ``algorithm.name`` applies its values to the fields the
user leaves unset, an explicit value wins, ``--explain`` names the fields the name set, and the
estimator and the critic come from the table."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from megatron_acrl.algo.advantages import compute_advantages
from megatron_acrl.config import (
    ALGORITHMS,
    AlgorithmConfig,
    AlgorithmName,
    Config,
    ConfigError,
    RolloutConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    load_config_with_sources,
)
from megatron_acrl.config.algorithm import FromRollout
from megatron_acrl.config.loader import _build, _field_docs, _read_yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_dense.yaml"  # rollout.max_new_tokens 12
DAPO = {
    "clip_high": 0.28,
    "loss_agg": "token-mean",
    "dynamic_sampling": True,
    "overlong_buffer_len": 16 // 5,  # rollout.max_new_tokens defaults to 16
    "overlong_penalty": 1.0,
}


def _resolved(value: object) -> object:
    return value.rule(RolloutConfig()) if isinstance(value, FromRollout) else value


def test_the_table_names_every_algorithm_and_only_valid_fields():
    assert list(ALGORITHMS) == list(typing.get_args(AlgorithmName))
    names = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    docs = _field_docs(AlgorithmConfig)
    for name, spec in ALGORITHMS.items():
        values = {**spec.defaults, **spec.requires}
        assert set(values) <= names - {"name"}, name
        assert not set(spec.defaults) & set(spec.requires), name
        # The values make a valid section, and every field the name sets says so in its doc.
        AlgorithmConfig(name=name, **{k: _resolved(v) for k, v in values.items()})
        for key in values:
            assert f"name {name}" in docs[key], (name, key)
    assert {n: s.estimator for n, s in ALGORITHMS.items()} == {
        "grpo": "group",
        "dr_grpo": "group",
        "dapo": "group",
        "ppo": "gae",
    }
    assert [n for n, s in ALGORITHMS.items() if s.needs_critic] == ["ppo"]
    with pytest.raises(TypeError):
        ALGORITHMS["dapo"].defaults["clip_high"] = 0.3  # type: ignore[index]


def test_dapo_applies_its_values():
    cfg, sources = load_config_with_sources(None, ["algorithm.name=dapo"])
    a = cfg.algorithm
    assert {k: getattr(a, k) for k in DAPO} == DAPO
    assert sources == {
        "algorithm.clip_high": "algorithm.name=dapo",
        "algorithm.loss_agg": "algorithm.name=dapo",
        "algorithm.dynamic_sampling": "algorithm.name=dapo",
        "algorithm.overlong_buffer_len": "algorithm.name=dapo: rollout.max_new_tokens // 5",
        "algorithm.overlong_penalty": "algorithm.name=dapo",
    }
    # Every other field is GRPO's (the dataclass default).
    assert dataclasses.replace(a, name="grpo", **{k: getattr(AlgorithmConfig(), k) for k in DAPO}) == (
        AlgorithmConfig()
    )
    # The buffer follows the run's response limit, and is at least one token.
    assert load_config(TINY, ["algorithm.name=dapo"]).algorithm.overlong_buffer_len == 2
    short = ["algorithm.name=dapo", "rollout.max_new_tokens=3"]
    assert load_config(None, short).algorithm.overlong_buffer_len == 1


def test_an_explicit_value_wins(tmp_path):
    cfg, sources = load_config_with_sources(None, ["algorithm.name=dapo", "algorithm.clip_high=0.2"])
    assert cfg.algorithm.clip_high == 0.2 and "algorithm.clip_high" not in sources
    assert cfg.algorithm.loss_agg == "token-mean"
    # In the YAML too, even where the value equals the field's own default.
    path = tmp_path / "dapo.yaml"
    path.write_text("algorithm:\n  name: dapo\n  overlong_buffer_len: 0\n  loss_agg: seq-mean-token-mean\n")
    cfg, sources = load_config_with_sources(path)
    assert (cfg.algorithm.overlong_buffer_len, cfg.algorithm.loss_agg) == (0, "seq-mean-token-mean")
    assert set(sources) == {"algorithm.clip_high", "algorithm.dynamic_sampling", "algorithm.overlong_penalty"}
    # And an override beats the YAML, whichever sets the name.
    cfg = load_config(path, ["algorithm.overlong_buffer_len=4", "algorithm.name=grpo"])
    assert (cfg.algorithm.clip_high, cfg.algorithm.overlong_buffer_len) == (0.2, 4)


def test_dr_grpo_applies_and_requires_its_values():
    cfg, sources = load_config_with_sources(None, ["algorithm.name=dr_grpo"])
    assert (cfg.algorithm.grpo_norm_std, cfg.algorithm.loss_agg) == (False, "seq-mean-token-sum-norm")
    assert sources == {
        "algorithm.grpo_norm_std": "algorithm.name=dr_grpo",
        "algorithm.loss_agg": "algorithm.name=dr_grpo",
    }
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.name=dr_grpo", "algorithm.grpo_norm_std=true"])
    assert err.value.errors == [
        (
            "algorithm.grpo_norm_std",
            "algorithm.name=dr_grpo requires grpo_norm_std=false, got true: leave grpo_norm_std unset "
            "(the name sets it) or choose another algorithm.name",
        )
    ]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_grpo_and_ppo_configs_are_unchanged_field_for_field(path):
    """A shipped config (all grpo) and its ppo twin load exactly as the dataclasses alone build them
    (an async one with the lag sweep's correction defaults, which are the only sources)."""
    from megatron_acrl.config.loader import apply_async_correction_defaults

    data = _read_yaml(path)
    assert data["algorithm"]["name"] == "grpo"
    for name in ("grpo", "ppo"):
        data["algorithm"]["name"] = name
        cfg, sources = load_config_with_sources(path, [f"algorithm.name={name}"])
        want, from_async = apply_async_correction_defaults(data)
        assert sources == from_async and cfg == _build(Config, want, "")
        assert not any(k.startswith("algorithm.") for k in sources)


def test_a_resolved_config_round_trips_without_sources():
    """A checkpoint's config (every field written out) loads back the same, nothing from the name."""
    cfg = load_config(TINY, ["algorithm.name=dapo"])
    again, sources = load_config_with_sources(None, [])
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert sources == {} and again == Config()


def test_an_unknown_or_ill_typed_name_is_refused_not_ignored():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.name=dapoo"])
    assert "did you mean 'dapo'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.name=[dapo]"])
    assert err.value.errors[0][0] == "algorithm.name"
    # A bad rollout section is reported once, with the rest, not tripped over by dapo's buffer.
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.name=dapo", "rollout.max_new_tokens=many", "training.lr=fast"])
    assert [p for p, _ in err.value.errors] == ["rollout.max_new_tokens", "training.lr"]


def test_explain_names_the_fields_the_name_set():
    res = subprocess.run(
        [sys.executable, "-m", "megatron_acrl.config", str(TINY), "algorithm.name=dapo", "--explain"],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = res.stdout.splitlines()
    assert "  algorithm.clip_high: float = 0.28  (from algorithm.name=dapo)" in lines
    assert "  algorithm.dynamic_sampling: bool = True  (from algorithm.name=dapo)" in lines
    want = "  algorithm.overlong_buffer_len: int = 2  (from algorithm.name=dapo: rollout.max_new_tokens // 5)"
    assert want in lines
    assert "  algorithm.clip_low: float = 0.2" in lines  # not set by the name: no mark
    assert "  correction.gamma: float = 0.65" in lines  # the config's values, not the defaults


def _group_batch() -> dict[str, torch.Tensor]:
    return {
        "rewards": torch.tensor([1.0, 0.0, 0.0, 0.0]),
        "group_ids": torch.tensor([1, 1, 2, 2]),
        "loss_mask": torch.ones(4, 2),
    }


def test_the_estimator_comes_from_the_name():
    """dr_grpo by name alone does not divide by the std (it needed grpo_norm_std: false before);
    dapo keeps GRPO's std; ppo asks for the critic's values."""
    adv = {
        n: compute_advantages(_group_batch(), load_config(None, [f"algorithm.name={n}"]))[0]
        for n in ("grpo", "dr_grpo", "dapo")
    }
    assert adv["dr_grpo"][:2, 0].tolist() == [0.5, -0.5]
    std = 2**-0.5 + 1e-6
    assert adv["grpo"][:2, 0].tolist() == pytest.approx([0.5 / std, -0.5 / std])
    assert torch.equal(adv["dapo"], adv["grpo"])
    with pytest.raises(KeyError, match="needs tb\\['values'\\]"):
        compute_advantages(_group_batch(), load_config(None, ["algorithm.name=ppo"]))
