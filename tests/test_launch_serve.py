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
from megatron_acrl.warmstart.tiny_model import build_checkpoint

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


def _routable_local_address() -> str:
    from sglang_bridge.listeners import address_towards, interface_of

    try:
        address = address_towards("http://192.0.2.123")  # TEST-NET-1: only the route is looked up
    except OSError:
        pytest.skip("this machine has no route off loopback")
    if interface_of(address) is None:
        pytest.skip("no interface holds this machine's routable address")
    return address


def test_a_cpu_server_binds_gloo_to_its_interface_towards_the_trainer(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Multi-node CPU servers: gloo would bind the host name's address (often loopback), which the
    trainer on another node cannot dial; the server task sets GLOO_SOCKET_IFNAME to its interface
    towards MASTER_ADDR, and leaves a user's choice, a GPU server and a local trainer alone."""
    from launch.serve import gloo_interface
    from sglang_bridge.listeners import interface_of

    address = _routable_local_address()
    ifname = interface_of(address)
    cfg = load_config(ROOT / "configs/tiny_dense.yaml", [f"model.hf_path={ckpt}", "rollout.device=cpu"])
    slot = ServerSlot(1, "0.0.0.0", 30001, None)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_ADDR", address)
    _, env = server_command(cfg, slot, "k-test", tmp_path, "<key file>")
    assert env["GLOO_SOCKET_IFNAME"] == ifname
    assert gloo_interface("cuda", {"MASTER_ADDR": address}) is None  # NCCL picks its own
    assert gloo_interface("cpu", {"MASTER_ADDR": address, "GLOO_SOCKET_IFNAME": "ib0"}) is None
    assert gloo_interface("cpu", {"MASTER_ADDR": "127.0.0.1"}) is None
    assert gloo_interface("cpu", {"MASTER_ADDR": "localhost"}) is None
    assert gloo_interface("cpu", {}) is None
    assert gloo_interface("cpu", {"MASTER_ADDR": "no-such-host.invalid"}) is None
