"""Config: YAML + dotted overrides, every class of bad input, --explain."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from megatron_acrl.config import (
    Config,
    ConfigError,
    CorrectionConfig,
    ParallelConfig,
    config_from_dict,
    config_to_dict,
    explain,
    load_config,
    parse_overrides,
)
from megatron_acrl.config.loader import _field_docs

ROOT = Path(__file__).resolve().parents[1]


def error_of(fn, *a, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*a, **kw)
    return str(info.value)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):  # study grids (configs/study) are checked in test_study.py
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # Round trip: the dict form loads back to the same config.
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_dotted_overrides_are_typed():
    cfg = load_config(
        ROOT / "configs/tiny_dense.yaml",
        [
            "correction.gamma=0.8",
            "parallel.tp=2",
            "rollout.fp8_block_size=[64, 64]",
            "correction.method=tis",
            "training.checkpoint_dir=null",
            "correction.masks=[seq_mis]",
        ],
    )
    assert cfg.correction.gamma == 0.8 and isinstance(cfg.correction.gamma, float)
    assert cfg.parallel.tp == 2
    assert cfg.rollout.fp8_block_size == (64, 64)
    assert cfg.correction.masks == ("seq_mis",)
    assert cfg.training.checkpoint_dir is None


def test_unknown_key_suggests_nearest():
    msg = error_of(load_config, None, ["correction.gama=0.8"])
    assert "correction.gama" in msg and "did you mean 'correction.gamma'" in msg
    msg = error_of(config_from_dict, {"corection": {}})
    assert "did you mean 'correction'" in msg


def test_wrong_type_names_key_and_type():
    msg = error_of(load_config, None, ["training.micro_batch_size=four"])
    assert "training.micro_batch_size" in msg and "expected int" in msg
    assert "expected bool" in error_of(load_config, None, ["parallel.sequence_parallel=3"])
    assert "expected float" in error_of(load_config, None, ["correction.gamma=[1]"])
    assert "expected 2 entries" in error_of(load_config, None, ["rollout.fp8_block_size=[1, 2, 3]"])


def test_bad_choice_suggests_valid_one():
    msg = error_of(load_config, None, ["correction.method=icepo"])
    assert "correction.method" in msg and "did you mean 'icepop'" in msg


@pytest.mark.parametrize(
    ("override", "key", "words"),
    [
        (["algorithm.clip_low=0.3", "algorithm.clip_high=0.2"], "algorithm.clip_low", "must not exceed"),
        (["correction.gamma=-0.1"], "correction.gamma", ">= 0"),
        (["correction.tis_low=3.0"], "correction.tis_low", "smaller than tis_high"),
        (["correction.ema_decay=1.0"], "correction.ema_decay", "[0, 1)"),
        (["rollout.temperature=0"], "rollout.temperature", "> 0"),
        (["rollout.top_p=1.5"], "rollout.top_p", "(0, 1]"),
        (["algorithm.dual_clip=0.5"], "algorithm.dual_clip", "> 1"),
        (["training.lr=0"], "training.lr", "> 0"),
        (
            ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.world_size=6"],
            "parallel.dp",
            "!= world_size",
        ),
        (["parallel.tp=3"], "parallel.tp", "divisible by tp=3"),
        (["parallel.pp=3"], "parallel.pp", "divisible by pp*vpp"),
        (["parallel.ep=2"], "parallel.ep", "needs an MoE model"),
        (["rollout.max_new_tokens=1000"], "rollout.max_new_tokens", "max_position_embeddings"),
        (["task.name=gsm8k"], "task.data_path", "needs data_path"),
        (["parallel.vpp=2"], "parallel.vpp", "pp >= 2"),
        (["rollout.server_cpus=[1,1]"], "rollout.server_cpus", "distinct core numbers"),
        (["rollout.num_servers=2", "rollout.server_cpus=[0,1,2]"], "rollout.server_cpus", "split evenly"),
        (
            ["rollout.server_cpus=[1]", "rollout.server_urls=[http://a:1]"],
            "rollout.server_cpus",
            "started (and bound) elsewhere",
        ),
        # issue 22: routing and token-budget micro-batches
        (["rollout.router=sglang", "rollout.backend=replay"], "rollout.router", "set rollout.router=none"),
        (
            ["rollout.router=sglang", "rollout.router_policy=manual"],
            "rollout.router_policy",
            "'power_of_two'",
        ),
        (["rollout.router=nginx"], "rollout.router", "'sglang'"),
        (["rollout.router_port=70000"], "rollout.router_port", "valid TCP port"),
        (["training.max_tokens_per_microbatch=0"], "training.max_tokens_per_microbatch", ">= 1"),
        (
            ["training.max_tokens_per_microbatch=70"],  # max_prompt_len 64 + max_new_tokens 16 = 80
            "training.max_tokens_per_microbatch",
            "raise it to at least 80",
        ),
        (
            ["training.max_tokens_per_logprob_microbatch=79"],
            "training.max_tokens_per_logprob_microbatch",
            "longest possible sequence",
        ),
        (
            [
                "training.max_tokens_per_microbatch=80",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "rollout.max_new_tokens=17",
            ],
            "training.max_tokens_per_microbatch",
            "multiple of tp=2 under sequence parallelism = 82",
        ),
        (
            ["training.max_tokens_per_microbatch=256", "parallel.pp=2", "parallel.vpp=2"],
            "training.max_tokens_per_microbatch",
            "not supported with virtual pipelining",
        ),
        (["rollout.weight_sync_port=80"], "rollout.weight_sync_port", "[1024, 65535]"),
        (
            ["parallel.pp=2", "parallel.world_size=2", "rollout.weight_sync_port=65534"],
            "rollout.weight_sync_port",
            "runs past port 65535",
        ),
        (["rollout.bucket_size_mb=0"], "rollout.bucket_size_mb", "> 0"),
        (["rollout.weight_sync=rank_0"], "rollout.weight_sync", "per_source"),
        (
            [
                "parallel.pp=2",
                "parallel.world_size=2",
                "rollout.weight_lag_steps=1",
                "rollout.max_staleness=1",
            ],
            "rollout.weight_lag_steps",
            "set rollout.weight_sync=rank0",
        ),
    ],
)
def test_out_of_range_values(override, key, words):
    msg = error_of(load_config, None, override)
    assert key in msg and words in msg


def test_server_cpus_are_split_among_the_servers():
    r = load_config(None, ["rollout.num_servers=2", "rollout.server_cpus=[4,5,6,7]"]).rollout
    assert [r.cpus_of_server(k) for k in (0, 1)] == [(4, 5), (6, 7)]
    assert load_config(None, []).rollout.cpus_of_server(0) is None  # shared with the trainer


def test_moe_cross_checks():
    base = ["model.family=qwen3_moe", "model.num_experts=4"]
    assert "divisible by ep=3" in error_of(load_config, None, base + ["parallel.ep=3"])
    assert "sequence_parallel: true" in error_of(load_config, None, base + ["parallel.tp=2"])
    assert load_config(None, base + ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"])


def test_weight_sync_sources_follow_the_layout():
    moe = ["model.family=qwen3_moe", "model.num_experts=4"]
    layout = ["parallel.pp=2", "parallel.ep=2", "parallel.world_size=4"]
    assert load_config(None, moe + layout).weight_sync_sources == 4  # a stage x EP rank each
    assert load_config(None, ["parallel.pp=2", "parallel.world_size=2"]).weight_sync_sources == 2
    assert load_config(None, moe + layout + ["rollout.weight_sync=rank0"]).weight_sync_sources == 1


def test_several_errors_reported_together():
    msg = error_of(load_config, None, ["correction.gamma=-1", "training.lr=-1", "nope.x=1"])
    assert msg.count("\n  ") >= 3


def test_missing_file_and_bad_yaml(tmp_path):
    assert "not found" in error_of(load_config, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert "not valid YAML" in error_of(load_config, bad)
    notmap = tmp_path / "list.yaml"
    notmap.write_text("- 1\n")
    assert "mapping" in error_of(load_config, notmap)
    assert "section.key=value" in error_of(parse_overrides, ["gamma"])


def test_check_paths(tmp_path):
    cfg = load_config(None, ["task.name=gsm8k", f"task.data_path={tmp_path}/none.jsonl"])
    assert "task.data_path" in error_of(cfg.check_paths)
    (tmp_path / "ok.jsonl").write_text("{}\n")
    load_config(None, ["task.name=gsm8k", f"task.data_path={tmp_path}/ok.jsonl"]).check_paths()


def test_sections_are_frozen_and_validate_on_construction():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().model.hidden_size = 3  # type: ignore[misc]
    with pytest.raises(ConfigError, match="gamma"):
        CorrectionConfig(gamma=-1.0)
    assert ParallelConfig(tp=2).data_parallel_size(8) == 4
    with pytest.raises(ConfigError):
        ParallelConfig(tp=3).data_parallel_size(8)


def test_every_field_has_a_docstring():
    def walk(cls):
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no attribute docstring"
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name])

    walk(Config)


def test_explain_cli_lists_every_field():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_acrl.config", "--explain"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "\n".join(explain()).strip()
    for key in ("correction.gamma", "parallel.tp", "algorithm.loss_agg", "rollout.quantization"):
        assert key in out
    assert "control strength" in out
    # With a config: its values; a grpo config's name sets nothing, so nothing is marked.
    out = subprocess.run(
        [sys.executable, "-m", "megatron_acrl.config", str(ROOT / "configs/tiny_dense.yaml"), "--explain"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cfg = load_config(ROOT / "configs/tiny_dense.yaml")
    assert out.strip() == "\n".join(explain(cfg)).strip() and "(from " not in out
    assert "  correction.gamma: float = 0.65\n" in out and "  rollout.max_new_tokens: int = 12\n" in out


def test_cli_reports_errors_with_exit_code_2():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_acrl.config",
            str(ROOT / "configs/tiny_dense.yaml"),
            "correction.gama=1",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "did you mean 'correction.gamma'" in res.stderr


def test_fp8_mode_is_honoured_per_device(tmp_path):
    from megatron_acrl.servers.handle import RolloutServers
    from megatron_acrl.servers.transfer import resolve_fp8_mode

    def cfg(*overrides: str):
        return load_config(ROOT / "configs/tiny_dense.yaml", ["rollout.quantization=fp8_block", *overrides])

    assert resolve_fp8_mode(cfg(), "cpu") == "fake" and resolve_fp8_mode(cfg(), "cuda") == "real"
    # fake also on a cuda server (FP8-rounded bf16); real FP8 cannot be served by a CPU server
    assert resolve_fp8_mode(cfg("rollout.fp8_mode=fake"), "cuda") == "fake"
    with pytest.raises(ConfigError, match=r"rollout\.fp8_mode: real FP8 needs a cuda server"):
        resolve_fp8_mode(cfg("rollout.fp8_mode=real"), "cpu")
    tiny = ROOT / "configs/tiny_dense.yaml"
    bf16 = load_config(tiny, ["rollout.quantization=none", "rollout.fp8_mode=real"])
    assert resolve_fp8_mode(bf16, "cpu") == "real"  # nothing is quantized, so nothing to refuse
    # Refused before any server starts (the engine would otherwise launch one on the CPU first).
    with pytest.raises(ConfigError, match="rollout.fp8_mode"):
        RolloutServers(cfg("rollout.fp8_mode=real", "rollout.device=cpu"), tmp_path / "m", tmp_path)
    stress = cfg("rollout.fp8_rounding=toward_zero", "rollout.device=cuda")
    with pytest.raises(ConfigError, match="set rollout.fp8_mode=fake"):
        RolloutServers(stress, tmp_path / "m", tmp_path)
    # the trainer's unquantized weights cannot be evaluated on a server holding real FP8 weights
    trainer_eval = cfg("training.eval_trainer_weights=true", "rollout.device=cuda")
    with pytest.raises(ConfigError, match="training.eval_trainer_weights"):
        RolloutServers(trainer_eval, tmp_path / "m", tmp_path)
    with pytest.raises(ConfigError, match="training.eval_samples"):
        load_config(tiny, ["training.eval_samples=-1"])


def test_router_policies_are_the_ones_sglang_router_knows():
    """``rollout.router_policy`` offers exactly the bridge's policies, each known to sglang-router."""
    from typing import get_args

    from megatron_acrl.config import RouterPolicy
    from sglang_bridge.router import POLICIES

    assert set(get_args(RouterPolicy)) == set(POLICIES)


def test_logprob_budget_defaults_to_the_training_budget():
    t = load_config(None, ["training.max_tokens_per_microbatch=256"]).training
    assert t.logprob_token_budget == 256
    t = load_config(
        None, ["training.max_tokens_per_microbatch=256", "training.max_tokens_per_logprob_microbatch=512"]
    )
    assert t.training.logprob_token_budget == 512
    assert load_config(None, []).training.logprob_token_budget is None
