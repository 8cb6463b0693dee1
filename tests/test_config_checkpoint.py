"""Issue #36: the model config against its HF checkpoint, ACRL's reference lag, the keys a resume may
accept, and the messages of a full disk (the refusals themselves are rows of test_bad_inputs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_acrl.config import ConfigError, ModelConfig, load_config, load_config_with_sources
from megatron_acrl.megatron.checkpoint import human_size
from megatron_acrl.warmstart.tiny_model import build_checkpoint

BASE = Path(__file__).resolve().parents[1] / "configs" / "tiny_dense.yaml"
ARCH = ModelConfig(ffn_hidden_size=96, rotary_base=5e5, norm_epsilon=1e-5, tie_embeddings=False)


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny HF checkpoint whose architecture differs from the defaults in four fields."""
    return build_checkpoint(ARCH, seed=0, cache_dir=tmp_path_factory.mktemp("models"))


def _yaml_without(tmp: Path, *fields: str) -> Path:
    """The base config with ``model.<field>`` lines dropped (the YAML may omit what config.json says)."""
    lines = [ln for ln in BASE.read_text().splitlines() if ln.strip().split(":")[0] not in fields]
    path = tmp / "omits.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_config_that_omits_the_architecture_takes_it_from_config_json(hf_path: Path, tmp_path: Path):
    config = _yaml_without(tmp_path, "ffn_hidden_size")
    cfg, sources = load_config_with_sources(config, [f"model.hf_path={hf_path}"])
    m = cfg.model
    assert (m.ffn_hidden_size, m.rotary_base, m.norm_epsilon, m.tie_embeddings) == (96, 5e5, 1e-5, False)
    assert sources["model.rotary_base"] == str(hf_path / "config.json")  # what --explain shows
    assert m.max_position_embeddings == 128  # the YAML's, smaller than the checkpoint's: allowed


def test_a_disagreeing_field_names_both_values_and_the_fix(hf_path: Path):
    with pytest.raises(ConfigError) as err:
        load_config(BASE, [f"model.hf_path={hf_path}", "model.rotary_base=10000"])  # YAML: ffn 128
    keys = {k: msg for k, msg in err.value.errors}
    assert set(keys) == {"model.rotary_base", "model.ffn_hidden_size"}
    assert "10000 disagrees with" in keys["model.rotary_base"]
    assert "set model.rotary_base: 500000.0, or leave it out" in keys["model.rotary_base"]
    assert "which sets ffn_hidden_size = 96" in keys["model.ffn_hidden_size"]


def test_a_longer_context_than_the_checkpoints_is_refused(hf_path: Path):
    with pytest.raises(ConfigError, match="model.max_position_embeddings: 1024 disagrees"):
        load_config(
            BASE,
            [f"model.hf_path={hf_path}", "model.ffn_hidden_size=96", "model.max_position_embeddings=1024"],
        )


def test_the_tiny_local_model_is_built_from_the_config_alone():
    cfg = load_config(BASE, ["model.rotary_base=5e5"])
    assert cfg.model.hf_path is None and cfg.model.rotary_base == 5e5


def test_a_reachable_reference_lag_is_accepted():
    assert load_config(BASE, ["correction.reference_lag=0"]).acrl_reference_lag == 0
    lagged = load_config(BASE, ["rollout.weight_lag_steps=2", "correction.reference_lag=2"])
    assert lagged.acrl_reference_lag == 2 and lagged.max_sampling_lag == 2


def test_a_resume_that_changes_a_shape_is_not_told_to_allow_it():
    from megatron_acrl.run.resume import _changes_hint

    hint = _changes_hint(["model.ffn_hidden_size", "task.num_digits"])
    assert "model.ffn_hidden_size can never change on resume" in hint
    assert "resume_allow_changes=[task.num_digits]" in hint and "resume=false" not in hint


@pytest.mark.parametrize(
    ("n", "text"),
    [(512, "512 B"), (int(1.6 * 2**20), "1.6 MiB"), (3 * 2**30, "3.0 GiB"), (5 * 2**40, "5.0 TiB")],
)
def test_a_size_is_printed_in_a_fitting_unit(n: int, text: str):
    assert human_size(n) == text
