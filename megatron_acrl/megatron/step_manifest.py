"""What a committed step directory must hold, and which one a run resumes from.

Every checkpoint carries ``manifest.json``: the size and CRC-32 of each file of the step directory,
written by rank 0 after the fsync pass and before the rename that publishes the step
(:func:`megatron_acrl.megatron.checkpoint.save_step_atomically`). A resume verifies it
(:func:`verify_step`): a file deleted, truncated, grown or garbled in place (same size) names the
file. :func:`select_step_dir` picks the newest intact committed step, walking back from the one
``latest.json`` names (or from the newest step directory, when ``latest.json`` is gone, empty or
garbled) and saying why each newer one was passed over; a damaged step is never loaded, and nothing
here deletes or rewrites anything.

CRC-32, not a cryptographic hash: it guards against a damaged disk, a full disk and a careless
``cp``, not against someone who can write the checkpoint (who owns the run anyway: 0700).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
"""The manifest's name inside a step directory."""

_STEP_DIR = re.compile(r"step_(\d{8})")
_CHUNK = 1 << 22


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _files(step_dir: Path) -> list[Path]:
    return sorted(
        p for p in step_dir.rglob("*") if p.is_file() and p.relative_to(step_dir).as_posix() != MANIFEST
    )


def write_manifest(step_dir: Path) -> int:
    """Write ``step_dir/manifest.json`` (size and CRC-32 of every other file; fsynced, 0600);
    returns the step's total size in bytes."""
    files = {
        p.relative_to(step_dir).as_posix(): {"size": p.stat().st_size, "crc32": _crc32(p)}
        for p in _files(step_dir)
    }
    total = sum(f["size"] for f in files.values())
    fd = os.open(step_dir / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"version": 1, "total_bytes": total, "files": files}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    return total


def step_bytes(step_dir: Path) -> int:
    """The size of a committed step (its manifest's total, else the sum of its files)."""
    try:
        return int(json.loads((step_dir / MANIFEST).read_text())["total_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return sum(p.stat().st_size for p in _files(step_dir)) if step_dir.is_dir() else 0


def verify_step(step_dir: Path, *, need_manifest: bool, checksums: bool = True) -> str | None:
    """Why ``step_dir`` must not be loaded (None: it is intact). Without a manifest the step is
    accepted only when ``need_manifest`` is False (a checkpoint from before manifests);
    ``checksums=False`` checks presence and sizes only (a stat per file)."""
    if not step_dir.is_dir():
        return f"{step_dir} is missing"
    mpath = step_dir / MANIFEST
    if not mpath.exists():
        return f"{mpath} is missing" if need_manifest else None
    try:
        files = json.loads(mpath.read_text())["files"]
        assert isinstance(files, dict)
    except (OSError, ValueError, KeyError, AssertionError) as err:
        return f"{mpath} is unreadable ({type(err).__name__})"
    for rel, want in files.items():
        path = step_dir / rel
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{path} has {size} bytes, the manifest {want['size']} (truncated or overwritten)"
        if checksums and _crc32(path) != want["crc32"]:
            return f"{path} does not match its checksum in {mpath} (garbled)"
    return None


@dataclass
class Selection:
    """The step directory a resume loads (None: nothing committed here) and what was passed over."""

    step_dir: Path | None
    step: int | None
    passed_over: list[str] = field(default_factory=list)
    """One line per damaged step (or unreadable ``latest.json``) newer than ``step_dir``."""


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The ``step_<n>`` directories of ``root``, newest first."""
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


def has_checkpoints(root: Path) -> bool:
    """Whether ``root`` holds any checkpoint (committed or not): a fresh run there would overwrite it."""
    return (root / "latest.json").exists() or bool(step_dirs(root))


def read_latest(root: Path) -> tuple[int, str] | str | None:
    """``latest.json``'s (step, directory name); None when there is none; the problem as a string
    when it is empty or garbled."""
    latest = root / "latest.json"
    if not latest.exists():
        return None
    try:
        data = json.loads(latest.read_text())
        step, name = int(data["step"]), str(data["dir"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{latest} is unreadable ({type(err).__name__}: empty or garbled)"
    if _STEP_DIR.fullmatch(name) is None:
        return f"{latest} names {name!r}, not a step directory"
    return step, name


def select_step_dir(root: str | os.PathLike, *, checksums: bool = True) -> Selection:
    """The newest intact committed step of ``root`` (see module doc).

    Candidates: the step ``latest.json`` names (or, crashed mid-replacement, its ``.trash-`` copy),
    then older step directories; with ``latest.json`` unreadable or gone, every step directory,
    newest first. Steps newer than the one ``latest.json`` names were never committed and are not
    candidates. A manifest is required once any candidate has one (a checkpoint from before
    manifests has none at all). ``Selection.step_dir`` is None only when there is no candidate.
    """
    root = Path(root)
    latest = read_latest(root)
    passed: list[str] = []
    dirs = step_dirs(root)
    if isinstance(latest, str):
        passed.append(latest)
        candidates = dirs
    elif latest is None:
        if dirs:
            passed.append(f"{root / 'latest.json'} is missing")
        candidates = dirs
    else:
        step, name = latest
        named = root / name
        if not named.exists() and (root / f".trash-{name}").exists():
            named = root / f".trash-{name}"  # a crash mid-replacement of the same step
        candidates = [(step, named)] + [(n, p) for n, p in dirs if n < step]
    need = needs_manifest(root)
    for step, path in candidates:
        problem = verify_step(path, need_manifest=need, checksums=checksums)
        if problem is None:
            return Selection(path, step, passed)
        passed.append(f"{step_name(step)}: {problem}")
    return Selection(None, None, passed)


def needs_manifest(root: Path) -> bool:
    """Whether a step of ``root`` without a manifest is damaged: some step has one, or
    ``latest.json`` was written with manifests (``"manifest": true``). Else the checkpoints are from
    before manifests, and accepted without."""
    if any((p / MANIFEST).exists() for _, p in step_dirs(root)):
        return True
    try:
        return bool(json.loads((root / "latest.json").read_text()).get("manifest"))
    except (OSError, ValueError, AttributeError):
        return False
