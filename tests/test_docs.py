"""What the docs name exists: every ``raysinga.x.y`` import path resolves, every file of the
repository they point at is there, and the benchmark tables are the recorded runs'."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
DOTTED = re.compile(r"(?<![\w/.])raysinga(?:\.\w+)+")
FILE = re.compile(r"`((?:raysinga|actors|kernels|benchmarks|examples|tests|docs|\.ci)/[\w./-]+)`")


def _resolves(name: str) -> bool:
    """Whether ``name`` is a module, or an attribute of the longest module it starts with."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            obj = importlib.import_module(module)
            for attr in parts[end:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def _named(pattern: re.Pattern) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for page in PAGES:
        for m in pattern.finditer(page.read_text()):
            name = m.group(1) if pattern.groups else m.group(0)
            out.setdefault(name.rstrip("."), []).append(page.name)
    return out


def test_every_import_path_the_docs_name_resolves():
    pytest.importorskip("ray.tune")  # raysinga.tune needs it
    broken = {n: pages for n, pages in _named(DOTTED).items() if not _resolves(n)}
    assert not broken, f"import paths the docs name that do not resolve: {broken}"


IMPORT = re.compile(
    r"^\s*(?:from\s+(raysinga[\w.]*)\s+import\s+([\w, ]+)|import\s+(raysinga[\w.]*))", re.M
)


def test_every_import_in_the_docs_code_resolves():
    pytest.importorskip("ray.tune")
    broken = []
    for page in PAGES:
        for m in IMPORT.finditer(page.read_text()):
            if m.group(3):
                names = [m.group(3)]
            else:
                names = [f"{m.group(1)}.{n.strip().split()[0]}" for n in m.group(2).split(",")]
            broken += [f"{page.name}: {n}" for n in names if not _resolves(n)]
    assert not broken, f"imports in the docs that fail: {broken}"


def test_every_file_the_docs_name_exists():
    missing = {n: pages for n, pages in _named(FILE).items() if not any(REPO.glob(n.rstrip("/")))}
    assert not missing, f"files the docs name that are not in the repository: {missing}"


def test_the_benchmark_tables_are_the_recorded_runs():
    spec = importlib.util.spec_from_file_location("report", REPO / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    sys.modules["report"] = report  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(report)
    finally:
        del sys.modules["report"]
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert report.drawn(text) == text, (
        "docs/benchmarks.md's tables differ from benchmarks/results: run "
        "`python benchmarks/report.py docs docs/benchmarks.md`"
    )
    assert len(report.BLOCK.findall(text)) >= 10
