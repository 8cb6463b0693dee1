"""The house's layers hold: import-linter's contracts (pyproject.toml) and what they cannot say.

* every contract in ``[tool.importlinter]`` is kept (``lint-imports``; ``make lint`` runs it too);
* every module of the four packages sits on a floor of the layers contract, so a new room cannot
  slip in unconstrained;
* no import circle anywhere, deferred (function-level) imports included, also between rooms of one
  floor (the layers contract allows those to import each other);
* the pure rooms (correction, losses, advantages, tasks, batch) import no ``torch.distributed``:
  import-linter cannot forbid an external package's subpackage, so this reads the source;
* the check can fail: an upward import and a circle planted in a copy of the tree are caught.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("launch", "megatron_acrl", "sglang_bridge", "ckernels")
PURE = ("correction", "algo", "tasks", "batch")
PLANT = "\n\ndef _planted():\n    from megatron_acrl import train\n\n    return train\n"


def _contracts(root: Path = ROOT) -> list[dict]:
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), "--no-cache", "--no-logo"], cwd=root, capture_output=True, text=True, timeout=300
    )


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _graph(root: Path) -> grimp.ImportGraph:
    """The import graph of the tree at ``root`` (deferred imports included)."""
    if root == ROOT:
        return grimp.build_graph(*PACKAGES, cache_dir=None)
    # Another tree: in a fresh interpreter started there, so that its packages, not the installed
    # ones already imported here, are the ones grimp finds.
    code = (
        f"import grimp, json; g = grimp.build_graph(*{PACKAGES!r}, cache_dir=None); "
        "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    graph = grimp.ImportGraph()
    for module, imported in json.loads(out.stdout).items():
        graph.add_module(module)
        for other in imported:
            graph.add_import(importer=module, imported=other)
    return graph


def test_contracts_are_kept():
    res = _lint(ROOT)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout


def test_every_module_is_on_a_floor():
    (layers,) = [c for c in _contracts() if c["type"] == "layers"]
    rooms = {r.strip() for floor in layers["layers"] for r in floor.replace("|", ":").split(":")}
    graph = _graph(ROOT)
    loose = []
    for module in sorted(graph.modules):
        if module in PACKAGES or module == "megatron_acrl.__main__":
            continue
        if not any(module == r or module.startswith(r + ".") for r in rooms):
            loose.append(module)
    assert not loose, f"modules on no floor of the layers contract (add them to pyproject.toml): {loose}"


def test_no_import_circles_deferred_imports_included():
    assert _cycles(_graph(ROOT)) == []


def _imports_torch_distributed(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            if any(a.name.split(".")[:2] == ["torch", "distributed"] for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("torch.distributed") or (
                node.module == "torch" and any(a.name == "distributed" for a in node.names)
            ):
                lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "distributed":
            if isinstance(node.value, ast.Name) and node.value.id == "torch":
                lines.append(node.lineno)
    return lines


def test_pure_rooms_use_no_torch_distributed():
    found = {}
    for name in PURE:
        base = ROOT / "megatron_acrl" / name
        files = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
        for f in files:
            if hits := _imports_torch_distributed(f):
                found[str(f.relative_to(ROOT))] = hits
    assert not found, f"torch.distributed in the pure rooms (collectives belong to Megatron's side): {found}"


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("house")
    shutil.copy(ROOT / "pyproject.toml", dst)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.c", "*.so"))
    return dst


def test_an_upward_deferred_import_is_caught(tree_copy: Path):
    target = tree_copy / "megatron_acrl" / "config" / "loader.py"
    original = target.read_text()
    target.write_text(original + PLANT)
    try:
        res = _lint(tree_copy)
    finally:
        target.write_text(original)
    assert res.returncode != 0 and "BROKEN" in res.stdout, res.stdout[-3000:]


def test_a_circle_within_a_floor_is_caught(tree_copy: Path):
    target = tree_copy / "megatron_acrl" / "rollout" / "evaluate.py"
    original = target.read_text()
    target.write_text(original + PLANT)
    try:
        cycles = _cycles(_graph(tree_copy))
    finally:
        target.write_text(original)
    assert any("megatron_acrl.rollout.evaluate" in c and "megatron_acrl.train" in c for c in cycles), cycles
