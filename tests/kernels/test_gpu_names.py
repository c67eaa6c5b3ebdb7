"""Every name the project asks of a CUDA module is defined there, checked without importing it.

The GPU modules of ``raysinga.kernels`` (``gpu*.py``, ``precision.py``'s CuPy side aside) import
CuPy at the top, so on a machine without it nothing imports them and a call of a name that moved
or was renamed (``gpu.sgd_update`` after the update kernels moved to ``gpu_optim``) shows only
on a GPU. This reads every Python file of the project, finds the names bound to those modules
(``from raysinga.kernels import gpu``, ``from . import gpu_blas as B``,
``import raysinga.kernels.gpu_graph``), and checks each attribute read through them against the
module's own top-level names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"  # raysinga.kernels in a checkout
GPU_MODULES = sorted(p.stem for p in KERNELS.glob("gpu*.py"))
SOURCES = sorted(
    p
    for d in ("raysinga", "actors", "kernels", "benchmarks", "examples", "tests")
    for p in (ROOT / d).rglob("*.py")
)


def top_level_names(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments, imports),
    including those under a top-level ``if``/``try``."""
    names: set[str] = set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    names.add((a.asname or a.name).split(".")[0])
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for h in getattr(node, "handlers", []):
                    visit(h.body)
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(path.read_text()).body)
    return names


def _module_of(node: ast.ImportFrom, path: Path) -> str | None:
    """The absolute module an ``ImportFrom`` reads names from, for the kernels' package only."""
    if node.level == 0:
        return node.module
    inside = path.parent == KERNELS
    if node.level == 1 and inside:
        return "raysinga.kernels" + (f".{node.module}" if node.module else "")
    return None


def uses(path: Path) -> list[tuple[str, str, int]]:
    """(module, attribute, line) for every attribute read through a name bound to a GPU module."""
    tree = ast.parse(path.read_text())
    alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _module_of(node, path) == "raysinga.kernels":
            for a in node.names:
                if a.name in GPU_MODULES:
                    alias[a.asname or a.name] = a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if a.asname and parts[:2] == ["raysinga", "kernels"] and len(parts) == 3:
                    if parts[2] in GPU_MODULES:
                        alias[a.asname] = parts[2]
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in alias
        ):
            found.append((alias[node.value.id], node.attr, node.lineno))
    return found


def test_the_gpu_modules_are_found():
    assert {"gpu", "gpu_optim", "gpu_blas", "gpu_graph", "gpu_launch"} <= set(GPU_MODULES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_read_from_a_gpu_module_is_defined_there(path):
    found = uses(path)
    if not found:
        return
    defined = {m: top_level_names(KERNELS / f"{m}.py") for m in {m for m, _, _ in found}}
    missing = [
        f"{path.relative_to(ROOT)}:{line}: {m}.{attr}"
        for m, attr, line in found
        if attr not in defined[m]
    ]
    assert not missing, "names not defined in their module: " + ", ".join(missing)
