"""The CPU/gloo patches are applied explicitly, once, by the entry point -- never by an import.

Each check runs in a fresh interpreter: patches are process-wide, so the test process itself (which
may have applied them for another test) cannot show what an import does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_acrl.megatron import cpu_compat

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the patches are a no-op with CUDA")

_CUDA_ATTRS = (
    "current_device",
    "synchronize",
    "get_rng_state",
    "set_rng_state",
    "manual_seed",
    "Stream",
    "Event",
    "current_stream",
    "default_stream",
    "stream",
)


def _run(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_every_megatron_module_patches_nothing():
    got = _run(
        f"""
import importlib, json, pkgutil
import torch
attrs = {_CUDA_ATTRS!r}
before = {{a: getattr(torch.cuda, a) for a in attrs}}
import megatron_acrl.megatron as pkg
names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."))
for name in names:
    importlib.import_module(name)
import megatron.core.tensor_parallel.mappings as mappings
import megatron.core.tensor_parallel.random as mrandom
from megatron_acrl.megatron import cpu_compat
print(json.dumps({{
    "modules": names,
    "changed": [a for a in attrs if getattr(torch.cuda, a) is not before[a]],
    "applied": cpu_compat.is_applied(),
    "function_modes": torch._C._len_torch_function_stack(),
    "megatron_patched": [
        f.__module__ for f in (mappings._gather_along_first_dim, mrandom._get_cuda_rng_state)
        if f.__module__ != mrandom.__name__ and f.__module__ != mappings.__name__
    ],
}}))
"""
    )
    assert "megatron_acrl.megatron.policy" in got["modules"] and len(got["modules"]) >= 10
    assert got["changed"] == [] and not got["applied"]
    assert got["function_modes"] == 0 and got["megatron_patched"] == []


def test_building_a_model_without_apply_names_it():
    got = _run(
        """
import json
from megatron_acrl.config import ModelConfig, ParallelConfig
from megatron_acrl.megatron.base import initialize_parallel
from megatron_acrl.megatron.model import build_model_chunks

errors = []
for build in (
    lambda: build_model_chunks(ModelConfig(), ParallelConfig(), None, None),
    lambda: initialize_parallel(ParallelConfig(), 0),
):
    try:
        build()
        errors.append(None)
    except RuntimeError as e:
        errors.append(str(e))
print(json.dumps(errors))
"""
    )
    assert len(got) == 2
    for message in got:
        assert message is not None and "megatron_acrl.megatron.cpu_compat.apply()" in message


def test_apply_runs_the_table_once():
    got = _run(
        """
import json
import torch
from megatron_acrl.megatron import cpu_compat

first, second = cpu_compat.apply(), cpu_compat.apply()
cpu_compat.require()
print(json.dumps({
    "returns": [first, second],
    "applied": cpu_compat.is_applied(),
    "device": torch.cuda.current_device(),
    "function_modes": torch._C._len_torch_function_stack(),
}))
"""
    )
    assert got == {"returns": [True, True], "applied": True, "device": "cpu", "function_modes": 1}


def test_the_table_names_every_documented_patch():
    ids = [p.id for p in cpu_compat.PATCHES]
    assert sorted(ids, key=lambda i: int(i[1:])) == [f"P{i}" for i in range(12)]
    assert ids[0] == "P0" and ids[-1] == "P4"  # the stub before megatron imports; the mode last
    doc = (ROOT / "docs" / "trainer.md").read_text()
    assert all(f"| {i} |" in doc for i in ids)
    assert all(p.apply.__doc__ for p in cpu_compat.PATCHES)


def test_the_checkpoint_writers_helper_ignores_stop_signals_and_dies_with_its_rank(tmp_path):
    """P12 (every host, issue #25): torchrun and SLURM signal a rank's whole process group, and
    megatron-core's checkpoint writer keeps a helper process per rank after its first save; the
    helper must outlive the stop signal (the rank's checkpoint goes through it) and not its rank."""
    import os
    import signal
    import time

    import psutil

    assert [p.id for p in cpu_compat.EVERY_HOST_PATCHES] == ["P12"]
    assert "| P12 |" in (ROOT / "docs" / "trainer.md").read_text()
    rank = subprocess.Popen(
        [sys.executable, "-c", (
            "import os, signal, sys, time\n"
            "from megatron_acrl.megatron import cpu_compat\n"
            "cpu_compat.apply()\n"
            "import megatron.core.dist_checkpointing.strategies.filesystem_async as fs\n"
            "q = fs._get_write_results_queue()\n"
            "for sig in (signal.SIGTERM, signal.SIGINT):  # the rank's own handlers: noted\n"
            "    signal.signal(sig, lambda *a: None)\n"
            "print(os.getpid(), flush=True)\n"
            "sys.stdin.readline()  # the test signals the group here\n"
            "q.put('after the stop signal'); print(q.get(), flush=True)\n"
            "time.sleep(600)\n"
        )],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert rank.stdout is not None and rank.stdin is not None
        assert int(rank.stdout.readline()) == rank.pid
        helpers = psutil.Process(rank.pid).children(recursive=True)
        assert helpers, "no helper process was started"
        os.killpg(rank.pid, signal.SIGTERM)  # what torchrun's agent does on a stop
        os.killpg(rank.pid, signal.SIGINT)  # and a Ctrl-C
        rank.stdin.write("\n")
        rank.stdin.flush()
        assert rank.stdout.readline().strip() == "after the stop signal"  # the helper still serves
        os.kill(rank.pid, signal.SIGKILL)  # the rank dies (a crash, the OOM killer)
        rank.wait(60)
        deadline = time.monotonic() + 60  # a bound, not a timing: PDEATHSIG acts at once
        while any(h.is_running() and h.status() != psutil.STATUS_ZOMBIE for h in helpers):
            assert time.monotonic() < deadline, f"helpers outlived their rank: {helpers}"
            time.sleep(0.1)
    finally:
        rank.kill()
