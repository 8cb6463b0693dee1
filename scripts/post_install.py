"""Post-install fix-ups that pip cannot express, applied inside the project's .venv only.

Idempotent: running it twice changes nothing the second time.

Fix-ups:

* torchvision (installed ``--no-deps`` because SGLang imports it): the PyPI wheel's compiled ops do not
  load against the CPU torch, yet ``torchvision/_meta_registrations.py`` registers fake kernels for
  ``torchvision::nms`` / ``torchvision::qnms`` unconditionally, so ``import torchvision`` raises
  ``operator torchvision::nms does not exist`` (and with it ``import sglang...``). We guard those two
  decorators with ``torchvision.extension._has_ops()``, exactly as the file already does for its other
  meta kernels.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

_GUARD_MARK = "# megatron-acrl: guarded"
_DECORATOR = re.compile(r'^@torch\.library\.register_fake\("torchvision::(nms|qnms)"\)\n', re.MULTILINE)


def _venv_root() -> Path:
    """The project's .venv: this script must run with that interpreter (``make setup`` does)."""
    project = Path(__file__).resolve().parents[1]
    venv = project / ".venv"
    if Path(sys.prefix).resolve() != venv.resolve():
        raise SystemExit(
            f"post_install: run with {venv}/bin/python (running under {sys.prefix}); refusing to "
            "patch an environment outside the project"
        )
    return venv


def _guard(match: re.Match[str]) -> str:
    op = match.group(1)
    # The decorator becomes a conditional one: a no-op identity when the compiled ops are missing.
    return (
        f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() '
        f"else (lambda fn: fn))  {_GUARD_MARK}\n"
    )


def patch_torchvision() -> str:
    """Guard the nms/qnms fake registrations; returns what was done ("patched", "already", "absent")."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return "absent"
    path = Path(spec.origin).parent / "_meta_registrations.py"
    if not path.resolve().is_relative_to(_venv_root().resolve()):
        raise SystemExit(
            f"post_install: torchvision at {path} is outside the project's .venv; not touching it"
        )
    text = path.read_text()
    if _GUARD_MARK in text:
        return "already"
    new, n = _DECORATOR.subn(_guard, text)
    if n != 2:
        raise SystemExit(
            f"post_install: expected 2 nms/qnms register_fake decorators in {path}, found {n}; "
            "torchvision version changed? (pinned 0.28.0 in requirements/cpu.lock)"
        )
    tmp = path.with_suffix(".py.tmp")
    tmp.write_text(new)
    tmp.replace(path)
    return "patched"


def main() -> None:
    print(f"post_install: torchvision meta registrations: {patch_torchvision()}")
    print("post_install: ok")


if __name__ == "__main__":
    main()
