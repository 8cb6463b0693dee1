"""Fixtures of the SGLang bridge tests: the served checkpoint's manifest and a weight synchronizer.

The tiny checkpoint and the two real SGLang servers every test of a session shares (``tiny_ckpt``,
``server_group``, ``sglang_server``, ``victim_server``) live in ``tests/conftest.py``, so the agent
tests (``tests/agent/test_agent_server*.py``) share them too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_bridge.server import SGLangServer
from sglang_bridge.weight_sync import DistributedWeightSynchronizer, Manifest


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
