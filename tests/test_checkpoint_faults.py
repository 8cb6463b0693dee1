"""Checkpoints under faults (issue #25): where they live, what a fresh run or a changed config may do
with them, damaged ones, a full disk.

The driver's own save and load (``resume.save_checkpoint`` / ``load_driver_state``) run for real in
a one-rank gloo world, with the atomic commit of ``checkpoint.save_step_atomically``; only the
policy is a stand-in that writes (and "loads") a distributed checkpoint's files: ``common.pt``,
``.metadata`` and a 64 KiB shard. Megatron's own save and load are tested in
``test_dist_checkpoint.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import megatron_acrl.megatron.checkpoint as checkpoint
import megatron_acrl.train as train
from megatron_acrl.config import Config, ConfigError, load_config
from megatron_acrl.config.exit_codes import CONFIG_ERROR
from megatron_acrl.megatron.step_manifest import MANIFEST, select_step_dir
from megatron_acrl.run.preflight import resolve_checkpoint_dir
from megatron_acrl.run.resume import DriverState, check_resume, load_driver_state, save_checkpoint

REPO = Path(__file__).resolve().parents[1]
BASE = str(REPO / "configs" / "tiny_dense.yaml")


@pytest.fixture(scope="module", autouse=True)
def world(tmp_path_factory):
    """A one-rank gloo world: the commit's barriers and the load's broadcast run for real."""
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class StandInPolicy:
    """Writes a distributed checkpoint's files into ``<step dir>/policy``; records what it loads."""

    def __init__(self) -> None:
        self.step = 0
        self.loaded: list[int | None] = []

    def save_checkpoint(self, directory, also=()):
        def write(d: Path) -> None:
            (d / "policy").mkdir()
            torch.save({"step": self.step}, d / "policy" / "common.pt")
            (d / "policy" / ".metadata").write_bytes(os.urandom(512))
            (d / "policy" / "__0_0.distcp").write_bytes(os.urandom(1 << 16))

        return checkpoint.save_step_atomically(directory, self.step, [write, *also])

    def load_checkpoint(self, directory, step=None) -> bool:
        self.loaded.append(step)
        return True


def _cfg(root: Path, *extra: str) -> Config:
    return load_config(BASE, [f"training.checkpoint_dir={root}", "logging.wandb_mode=disabled", *extra])


def _ctx(cfg: Config, run_dir: Path) -> SimpleNamespace:
    run_dir.mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(
        cfg=cfg,
        rank=0,
        critic=None,
        policy=StandInPolicy(),
        prompt_stream=None,
        run_dir=run_dir,
        last_checkpoint_step=-1,
    )


def _save_steps(root: Path, steps: list[int], *extra: str) -> SimpleNamespace:
    ctx = _ctx(_cfg(root, *extra), root.parent / "run")
    for step in steps:
        ctx.policy.step = step
        save_checkpoint(ctx, DriverState(step=step, weight_version=step, prompts_consumed=8 * step))
    return ctx


def _resume(root: Path, *extra: str) -> tuple[DriverState, Path | None, SimpleNamespace]:
    ctx = _ctx(_cfg(root, *extra), root.parent / "run")
    state, step_dir = load_driver_state(ctx)
    return state, step_dir, ctx


# -- where checkpoints live, and who may write there ------------------------------------------------


def test_a_relative_checkpoint_dir_lives_in_the_run_directory(tmp_path, monkeypatch):
    args = argparse.Namespace(run_dir=str(tmp_path / "runs" / "b"))
    cfg = resolve_checkpoint_dir(load_config(BASE, ["training.checkpoint_dir=ckpt"]), args)
    assert cfg.training.checkpoint_dir == str(tmp_path / "runs" / "b" / "ckpt")
    assert resolve_checkpoint_dir(cfg, args) == cfg  # absolute: kept
    # Through the entry point, started from another directory: the run gets the resolved one.
    got: list[Config] = []
    monkeypatch.setattr(train, "run", lambda cfg, args, prepare=None: got.append(cfg))
    monkeypatch.chdir(tmp_path)
    assert train.main(["--config", BASE, "training.checkpoint_dir=ck", "--run-dir", "runs/a"]) == 0
    assert got[0].training.checkpoint_dir == str(tmp_path / "runs" / "a" / "ck")


def test_a_fresh_run_never_overwrites_checkpoints(tmp_path, monkeypatch, capsys):
    root = tmp_path / "ck"
    _save_steps(root, [16])
    with pytest.raises(ConfigError) as err:
        check_resume(_cfg(root, "training.resume=false"))
    assert err.value.errors[0][0] == "training.resume" and "new directory" in err.value.errors[0][1]
    with pytest.raises(ConfigError):  # the driver's own load refuses too (run() without main)
        _resume(root, "training.resume=false")
    monkeypatch.setattr(train, "run", lambda *a, **k: pytest.fail("the run started"))
    argv = [f"training.checkpoint_dir={root}", "training.resume=false", "--run-dir", str(tmp_path / "run")]
    rc = train.main(["--config", BASE, *argv])
    assert rc == CONFIG_ERROR and "training.resume: is false" in capsys.readouterr().err
    assert json.loads((root / "latest.json").read_text())["step"] == 16


def test_a_resume_that_changes_the_model_or_the_data_is_refused_unless_allowed(tmp_path):
    root = tmp_path / "ck"
    _save_steps(root, [2])
    check_resume(_cfg(root, "training.lr=3e-4", "rollout.temperature=0.7"))  # neither model nor data
    changed = ("task.num_digits=1", "training.seed=7", "model.rotary_base=5e5")
    with pytest.raises(ConfigError) as err:
        check_resume(_cfg(root, *changed))
    keys = [k for k, _ in err.value.errors]
    assert keys == ["model.rotary_base", "task.num_digits", "training.seed", "training.resume_allow_changes"]
    assert "written with 2, this run has 1" in err.value.errors[1][1]
    allow = "training.resume_allow_changes=[task.num_digits, training.seed, model.rotary_base]"
    check_resume(_cfg(root, *changed, allow))


# -- damaged checkpoints --------------------------------------------------------------------------------


def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[1024 : 1024 + 4096] = os.urandom(4096)
    path.write_bytes(bytes(data))


DAMAGE = {
    # name: (damage step 3 of steps 1-3, the step resumed, words naming the damage)
    "latest_empty": (lambda r: (r / "latest.json").write_text(""), 3, "latest.json is unreadable"),
    "latest_garbled": (
        lambda r: (r / "latest.json").write_text('{"step": 3, "di'),
        3,
        "latest.json is unreadable",
    ),
    "step_dir_gone": (lambda r: (r / "step_00000003").rename(r / "elsewhere"), 2, "step_00000003 is missing"),
    "common_truncated": (
        lambda r: os.truncate(r / "step_00000003/policy/common.pt", 100),
        2,
        "common.pt has 100 bytes",
    ),
    "shard_deleted": (
        lambda r: (r / "step_00000003/policy/__0_0.distcp").unlink(),
        2,
        "__0_0.distcp is missing",
    ),
    "metadata_deleted": (
        lambda r: (r / "step_00000003/policy/.metadata").unlink(),
        2,
        ".metadata is missing",
    ),
    "driver_deleted": (lambda r: (r / "step_00000003/driver.pt").unlink(), 2, "driver.pt is missing"),
    "manifest_deleted": (lambda r: (r / "step_00000003" / MANIFEST).unlink(), 2, "manifest.json is missing"),
    "shard_garbled_same_size": (
        lambda r: _garble(r / "step_00000003/policy/__0_0.distcp"),
        2,
        "__0_0.distcp does not match its checksum",
    ),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_latest_checkpoint_is_named_kept_and_passed_over(kind, tmp_path, capsys):
    root = tmp_path / "ck"
    _save_steps(root, [1, 2, 3])
    damage, want, words = DAMAGE[kind]
    damage(root)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    check_resume(_cfg(root))  # the pre-flight (sizes only) does not refuse: an intact step exists
    state, step_dir, ctx = _resume(root)
    err = capsys.readouterr().err
    assert (state.step, state.prompts_consumed, ctx.policy.loaded) == (want, 8 * want, [want])
    assert step_dir == root / f"step_{want:08d}"
    assert words in err and "kept, not loaded" in err, err
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before  # nothing touched
    # The resumed run saves step 3 again: a damaged step_3 is kept aside, never deleted.
    ctx.policy.step = 3
    save_checkpoint(ctx, DriverState(step=3))
    assert select_step_dir(root).step == 3 and select_step_dir(root).passed_over == []
    if want == 2 and kind != "step_dir_gone":
        kept = root / "damaged-step_00000003"
        assert {p.relative_to(kept) for p in kept.rglob("*") if p.is_file()} == {
            p.relative_to(root / "step_00000003") for p in before if "step_00000003" in str(p)
        }
    if kind.startswith("latest"):
        assert (root / "latest.json.damaged").exists()  # the unreadable latest.json, kept beside


def test_no_intact_checkpoint_is_refused_with_the_fix(tmp_path, monkeypatch, capsys):
    root = tmp_path / "ck"
    _save_steps(root, [1, 2])
    _garble(root / "step_00000002/policy/__0_0.distcp")
    os.truncate(root / "step_00000001/policy/common.pt", 10)
    with pytest.raises(ConfigError) as err:
        _resume(root)
    msg = err.value.errors[0][1]
    assert "step_00000002/policy/__0_0.distcp does not match" in msg and "step_00000001" in msg
    assert "restore the damaged files" in msg and "new training.checkpoint_dir" in msg
    # Before anything starts, every rank checks the sizes (the checksums are rank 0's, at the load):
    # a file gone is enough to refuse there.
    (root / "step_00000002" / "driver.pt").unlink()
    monkeypatch.setattr(train, "run", lambda *a, **k: pytest.fail("the run started"))
    argv = ["--config", BASE, f"training.checkpoint_dir={root}", "--run-dir", str(tmp_path / "run")]
    assert train.main(argv) == CONFIG_ERROR
    assert "holds no intact checkpoint" in capsys.readouterr().err


def test_a_checkpoint_from_before_manifests_still_resumes(tmp_path):
    root = tmp_path / "ck"
    _save_steps(root, [1])
    (root / "step_00000001" / MANIFEST).unlink()
    (root / "latest.json").write_text(json.dumps({"step": 1, "dir": "step_00000001"}))  # no "manifest"
    state, _, _ = _resume(root)
    assert state.step == 1


# -- a full disk ----------------------------------------------------------------------------------------


def test_a_save_that_would_not_fit_is_refused_before_writing(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    ctx = _save_steps(root, [1])
    size = sum(p.stat().st_size for p in (root / "step_00000001").rglob("*") if p.is_file())
    usage = SimpleNamespace(total=1 << 40, used=0, free=size // 2)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage)
    ctx.policy.step = 2
    with pytest.raises(checkpoint.CheckpointSpaceError) as err:
        save_checkpoint(ctx, DriverState(step=2))
    assert "RL step 2: not enough free space for the next checkpoint (step_00000002)" in str(err.value)
    assert re.search(r"about [\d.]+ (KiB|MiB) needed", str(err.value)), str(err.value)  # not "0.00 GiB"
    assert "Free at least" in str(err.value) and "training.checkpoint_dir" in str(err.value)
    assert sorted(p.name for p in root.iterdir()) == ["latest.json", "step_00000001"]  # no partial save


def test_partial_saves_are_removed_at_start(tmp_path, capsys):
    root = tmp_path / "ck"
    _save_steps(root, [1])
    partial = root / ".tmp-step_00000002" / "policy"
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"x" * 1000)  # a save that ran out of disk
    state, _, _ = _resume(root)
    assert state.step == 1 and not (root / ".tmp-step_00000002").exists()
    assert "removed the partial save" in capsys.readouterr().err
