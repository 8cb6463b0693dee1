"""Fixtures of the SGLang bridge tests: one tiny checkpoint, real SGLang servers started once per session.

Server start-up is ~25 s on 2 cores, so the session starts two servers concurrently and every test
shares them: ``sglang_server`` (tests that change weights restore them) and ``victim_server`` (the
one killed by the fault-injection test). The ServerGroup context manager stops both even when a test
fails or the run is interrupted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_acrl.config import ModelConfig
from megatron_acrl.warmstart.tiny_model import build_checkpoint
from sglang_bridge.server import ServerGroup, ServerSpec, SGLangServer
from sglang_bridge.weight_sync import DistributedWeightSynchronizer, Manifest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(ModelConfig(), seed=0, cache_dir=tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def server_group(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerGroup]:
    spec = ServerSpec(model_path=str(tiny_ckpt), device="cpu")
    logs = tmp_path_factory.mktemp("sglang-logs")
    with ServerGroup([spec, spec], log_dir=logs, startup_timeout_s=240) as group:
        yield group


@pytest.fixture(scope="session")
def sglang_server(server_group: ServerGroup) -> SGLangServer:
    return server_group.servers[0]


@pytest.fixture(scope="session")
def victim_server(server_group: ServerGroup) -> SGLangServer:
    return server_group.servers[1]


@pytest.fixture(scope="session")
def manifest(tiny_ckpt: Path) -> Manifest:
    return Manifest.from_checkpoint(tiny_ckpt)


@pytest.fixture(scope="session")
def synchronizer(sglang_server: SGLangServer, manifest: Manifest) -> Iterator[DistributedWeightSynchronizer]:
    sync = DistributedWeightSynchronizer([sglang_server.url], manifest, timeout_s=120)
    sync.connect()
    try:
        yield sync
    finally:
        sync.close()
