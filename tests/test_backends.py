"""Output a CPU user can act on: the entry point ignores exactly Megatron-Core's "Transformer Engine /
Apex is not installed" warnings (nothing else, and nothing at import time of a library module), and
says in one line which backends the run uses."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_acrl.config import load_config
from megatron_acrl.world.backends import (
    ABSENT_BACKEND_MESSAGES,
    backends_line,
    quiet_absent_backends,
    rollout_backends,
)

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")

# What megatron-core 0.16 says on a host without either package, and from where.
ABSENT = [
    (
        "megatron.core.optimizer",
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
    ),
    (
        "megatron.core.optimizer.optimizer",
        "Transformer Engine and Apex are not installed. Falling back to local implementations of "
        "multi_tensor_applier and multi_tensor_scale",
    ),
    (
        "megatron.core.optimizer.clip_grads",
        "Transformer Engine and Apex are not installed. Falling back to local implementations of "
        "multi_tensor_applier, multi_tensor_l2norm, and multi_tensor_scale",
    ),
    (
        "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
        "Transformer Engine and Apex are not installed. Falling back to local implementations of "
        "multi_tensor_applier and multi_tensor_scale",
    ),
    ("megatron.core.models.backends", "Apex is not installed. Falling back to Torch Norm"),
    ("megatron.core.models.gpt.gpt_layer_specs", "Apex is not installed. Falling back to Torch Norm"),
]

# Warnings that must still show: Megatron's others, the same words from someone else, another category.
KEPT = [
    (
        "megatron.core.transformer.transformer_config",
        "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
        UserWarning,
    ),
    ("megatron.core.optimizer", "Transformer Engine is too old for this optimizer", UserWarning),
    ("some_other_package", "Apex is not installed. Falling back to Torch Norm", UserWarning),
    ("megatron.core_extras", "Apex is not installed. Falling back to Torch Norm", UserWarning),
    ("megatron.core.models.backends", "Apex is not installed. Falling back to Torch Norm", FutureWarning),
]


def _shown(module: str, message: str, category: type[Warning]) -> bool:
    """Whether a warning raised from ``module`` passes the filters now installed."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit(message, category, filename=f"{module}.py", lineno=1, module=module)
    return len(seen) == 1


def test_the_filter_hides_exactly_megatrons_absent_backend_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # everything shows, as under `python -W always`
        assert all(_shown(mod, msg, UserWarning) for mod, msg in ABSENT)
        before = len(warnings.filters)
        quiet_absent_backends()
        quiet_absent_backends()  # idempotent: one filter per message, not two
        assert not [(mod, msg) for mod, msg in ABSENT if _shown(mod, msg, UserWarning)]
        assert [w for w in KEPT if not _shown(*w)] == []
        assert len(warnings.filters) == before + len(ABSENT_BACKEND_MESSAGES)


def _warned_messages(path: Path) -> list[str]:
    """The literal messages of ``warnings.warn(...)`` calls in ``path`` (an f-string's fields as {})."""
    messages = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "warnings.warn" and node.args):
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            messages.append(arg.value)
        elif isinstance(arg, ast.JoinedStr):
            messages.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in arg.values))
    return messages


def test_the_patterns_cover_every_absent_backend_warning_of_the_installed_megatron():
    """A newer megatron-core that words them differently fails here, not on a user's console."""
    import megatron.core

    root = Path(megatron.core.__file__).parent
    absent = re.compile(r"(Transformer Engine|Apex)\b.*\bnot installed", re.I)
    found = {
        message
        for path in root.rglob("*.py")
        if "not installed" in path.read_text()
        for message in _warned_messages(path)
        if absent.match(message)
    }
    assert len(found) >= 3, f"megatron-core's absent-backend warnings not found: {found}"
    for message in found:
        assert any(re.match(p, message, re.I) for p in ABSENT_BACKEND_MESSAGES), message


def test_the_entry_point_filters_before_megatron_is_imported_and_importing_it_filters_nothing():
    # `-m megatron_acrl.train` is how torchrun starts every rank; -W always shows every other warning.
    entry = subprocess.run(
        [sys.executable, "-W", "always", "-m", "megatron_acrl.train", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert entry.returncode == 0, entry.stderr[-3000:]
    assert "not installed" not in entry.stderr
    assert "Warning" in entry.stderr  # the others still show (torch's and Megatron's deprecations)
    imported = subprocess.run(
        [sys.executable, "-c", "import megatron_acrl.train"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert "Apex is not installed" in imported.stderr  # a library import filters nothing


SPAWNED = """
import importlib.util, multiprocessing as mp, sys
# As under `python -m megatron_acrl.train`: a spawned child (the checkpoint writer's helper) re-runs
# the entry module as __mp_main__ before its target.
sys.modules["__main__"].__spec__ = importlib.util.find_spec("megatron_acrl.train")
if __name__ == "__main__":
    child = mp.get_context("spawn").Process(target=print, args=("child ran",))
    child.start()
    child.join()
    sys.exit(child.exitcode)
"""


def test_a_child_the_entry_point_spawns_filters_them_too(tmp_path):
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNED)
    res = subprocess.run(
        [sys.executable, "-W", "always", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "child ran" in res.stdout
    assert "not installed" not in res.stderr, res.stderr[-3000:]


def test_the_backends_line_says_what_a_cpu_demo_runs_on():
    cfg = load_config(DEMO, [])
    line = backends_line(cfg, SimpleNamespace(device="cpu", fp8_mode="fake"))
    assert line.startswith("backends: megatron-core 0.")
    assert "local layers, torch norm, torch AdamW; no Transformer Engine, no Apex" in line
    assert line.endswith("SGLang 0.5.23 on cpu, FP8 fake-quant (fp8_block 32x32), router none"), line
    assert "\n" not in line


@pytest.mark.parametrize(
    "overrides, servers, said",
    [
        (["rollout.quantization=none"], SimpleNamespace(device="cpu", fp8_mode="fake"), "BF16 rollout"),
        (["rollout.router=sglang"], SimpleNamespace(device="cpu", fp8_mode="fake"), "router sglang-router"),
        (
            ["rollout.quantization=fp8_per_channel"],
            SimpleNamespace(device="cuda", fp8_mode="real"),
            "FP8 real",
        ),
        (["rollout.fp8_rounding=toward_zero"], SimpleNamespace(device="cpu", fp8_mode="fake"), "stress"),
        ([], None, "recorded rollouts (no SGLang)"),
    ],
)
def test_the_rollout_part_follows_the_config_and_the_servers(overrides, servers, said):
    assert said in rollout_backends(load_config(DEMO, overrides), servers)


def test_run_prints_the_backends_line_once_set_up(monkeypatch, capsys):
    import megatron_acrl.train as train

    class Stop(Exception):
        pass

    cfg = load_config(DEMO, [])
    ctx = SimpleNamespace(servers=SimpleNamespace(device="cpu", fp8_mode="fake"), close=lambda: None)
    monkeypatch.setattr(train, "setup_run", lambda cfg, args, stopping: ctx)

    def prepare(_ctx):
        raise Stop  # the line comes before the first thing the run does with its context

    with pytest.raises(Stop):
        train.run(cfg, argparse.Namespace(), prepare=prepare)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("backends: ")]
    assert len(lines) == 1 and "FP8 fake-quant" in lines[0], lines
