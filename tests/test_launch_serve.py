"""What a job's server task serves (``launch.serve.server_command``), without starting it.

Real FP8 rollout (a cuda server, fp8_mode auto or real) serves the FP8 copy of the checkpoint from the
run directory, the copy the trainer's weight-sync manifest is read from; fake-quant and CPU servers
serve the bf16 checkpoint. No GPU is needed to build the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.serve import ServerSlot, server_command
from megatron_acrl.config import ModelConfig, load_config
from megatron_acrl.tiny_model import build_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(ModelConfig(), seed=0, cache_dir=tmp_path_factory.mktemp("models"))


def _model_path(cmd: list[str]) -> Path:
    return Path(cmd[cmd.index("--model-path") + 1])


@pytest.mark.parametrize(
    ("overrides", "fp8_served"),
    [
        (["rollout.device=cuda", "rollout.quantization=fp8_block"], True),
        (["rollout.device=cuda", "rollout.quantization=fp8_block", "rollout.fp8_mode=fake"], False),
        (["rollout.device=cuda", "rollout.quantization=none"], False),
        (["rollout.device=cpu", "rollout.quantization=fp8_block"], False),
    ],
    ids=["cuda-real", "cuda-fake", "cuda-bf16", "cpu-fake"],
)
def test_server_serves_the_checkpoint_the_bridge_validates_against(
    ckpt: Path, tmp_path: Path, overrides: list[str], fp8_served: bool
) -> None:
    cfg = load_config(ROOT / "configs/tiny_dense.yaml", [f"model.hf_path={ckpt}", *overrides])
    cmd, _ = server_command(cfg, ServerSlot(0, "127.0.0.1", 30000, (0,)), None, tmp_path)
    assert "--quantization" not in cmd  # never SGLang's online (per-tensor) quantization
    served = _model_path(cmd)
    if not fp8_served:
        assert served == ckpt
        return
    bn, bk = cfg.rollout.fp8_block_size
    assert served == tmp_path / "served_fp8" / f"{ckpt.name}-fp8-block{bn}x{bk}"
    qc = json.loads((served / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == list(cfg.rollout.fp8_block_size)
