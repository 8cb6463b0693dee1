"""Build and load the project's small C kernels (plain C, called through ``ctypes``).

Some CPU hot spots are a few dozen tiny PyTorch ops whose dispatch costs more than their arithmetic
(the correction of a micro-batch, see ``correction/_fused_cpu.c``). Their C versions have no
Python or torch headers, so building one takes a fraction of a second with the system C compiler
(``$CC``, else ``cc``); nothing is compiled at install time that a user has to think about.

A library is built on first use into a cache directory keyed by a hash of the source, the flags,
the compiler's version and the machine type, and reused by every later process (several ranks
building at once each write a private file and rename it into place). Without a working compiler,
:func:`load_library` returns None and callers fall back to their PyTorch path; the reason is logged
once.

Flags: ``-O3`` plus the floating-point relaxations the kernels are written for (reassociated float64
sums, finite inputs on valid tokens, no errno); no ``-march=native``, so a cache shared by machines
of one architecture (a cluster's home directory) stays valid on all of them. A kernel whose results
depend on IEEE evaluation order passes its own flags (``load_library(source, cflags)``; the block-FP8
quantizer, ``sglang_bridge/_fp8_block.c``, does); the flags are part of the cache key.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

BASE_CFLAGS = ("-O3", "-fPIC", "-shared", "-std=c99", "-fno-math-errno", "-fno-trapping-math")
"""What every kernel is built with: none of these changes a floating-point result."""

CFLAGS = (
    *BASE_CFLAGS,
    "-fassociative-math",
    "-fno-signed-zeros",
    "-ffinite-math-only",
)


def cache_dir() -> Path:
    """Where built libraries live: ``$XDG_CACHE_HOME/megatron_acrl/native`` (``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megatron_acrl" / "native"


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


@functools.cache
def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(source: Path, out_dir: Path | None = None, cflags: tuple[str, ...] = CFLAGS) -> Path:
    """Compile ``source`` into a shared library (cached); returns its path.

    ``cflags``: the compiler flags (default :data:`CFLAGS`); a kernel whose results depend on IEEE
    evaluation order (exact rounding) passes its own set without the relaxations.

    Raises:
        RuntimeError: no C compiler, or the compilation failed (with the compiler's message).
    """
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC or install gcc/cc)")
    text = source.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [text, " ".join(cflags).encode(), _compiler_version(cc).encode(), platform.machine().encode()]
        )
    ).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    target = out_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", prefix=f".{source.stem}-", dir=out_dir)
    os.close(fd)
    try:
        res = subprocess.run([cc, *cflags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed:\n{res.stderr.strip()}")
        os.replace(tmp, target)  # atomic: a concurrent builder's identical file wins or loses whole
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load_library(source: Path, cflags: tuple[str, ...] = CFLAGS) -> ctypes.CDLL | None:
    """The built library of ``source`` (compiled with ``cflags``), or None (logged once) when it
    cannot be built or loaded."""
    try:
        return ctypes.CDLL(str(build(source, cflags=cflags)))
    except (OSError, RuntimeError) as exc:
        log.warning("native kernel %s unavailable, using the PyTorch path: %s", source.name, exc)
        return None
