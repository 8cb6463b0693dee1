"""The tree stays ruff-clean (line length 110): CI runs the tests, so lint rides along."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_and_format():
    for args in (["check", "."], ["format", "--check", "."]):
        res = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
