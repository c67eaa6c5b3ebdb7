"""What raysinga ships of itself to a node that lacks it: one package, assembled once per
content, that holds the roles and the kernel sources. The nodes that run it, and those named
without it, are emulated hosts (tests/cluster/test_submit.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from raysinga.cluster import node_probe, shipping

ROOT = Path(__file__).resolve().parents[2]


def test_the_assembled_package_holds_the_roles_and_the_kernel_sources(tmp_path):
    first = shipping.assembled(tmp_path)
    assert first.name == "raysinga"
    for rel in ("__init__.py", "actors/worker.py", "actors/server.py", "kernels/__init__.py"):
        assert (first / rel).is_file(), rel
    assert list((first / "kernels").rglob("*.cu")), "the CUDA sources are shipped too"
    assert not list(first.rglob("__pycache__"))
    assert shipping.assembled(tmp_path) == first  # built once per content
    probe = subprocess.run(
        [sys.executable, "-I", "-c", "import raysinga.actors.stub, raysinga.kernels"],
        cwd=first.parent,  # as a node's worker finds it: a directory on its path
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 0, probe.stderr


def test_the_probe_names_the_module_that_is_missing_not_only_the_one_imported(tmp_path):
    (tmp_path / "needs_absent.py").write_text("import raysinga_absent_dependency\n")
    sys.path.insert(0, str(tmp_path))
    try:
        found = node_probe.probe(("json", "needs_absent", "os"))
    finally:
        sys.path.remove(str(tmp_path))
    assert found["module"] == "needs_absent"
    assert found["missing"] == "raysinga_absent_dependency"
    assert "ModuleNotFoundError" in found["why"]
    assert node_probe.probe(("json",))["module"] == ""


def test_the_remedy_says_install_raysinga_only_where_raysinga_is_missing():
    remedy = shipping._remedy
    role = remedy("raysinga.actors.worker", "ml_dtypes")  # a dependency the role imports
    assert "pip install ml_dtypes" in role and "install raysinga" not in role, role
    assert "pip install pyyaml" in remedy("yaml", "yaml")  # pip's name, not the import's
    assert "install raysinga on that node" in remedy("raysinga", "raysinga")
    assert "--no-ship" in remedy("raysinga.actors.worker", "raysinga")
    assert "the job's `modules`" in remedy("mylayers", "mylayers", ("mylayers",))
    assert "pip install scipy" in remedy("mylayers", "scipy", ("mylayers",))  # its dependency
    assert "repair" in remedy("pyarrow", "")  # there, but failed as it loaded


def test_every_node_package_is_a_dependency_of_raysinga():
    """docs/cluster.md's list is a subset of what `pip install raysinga` brings."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    deps = {Requirement(r).name.lower() for r in md.requires("raysinga") if "extra" not in r}
    missing = [p for p in node_probe.NODE_PACKAGES.values() if p.lower() not in deps]
    assert not missing, missing
    text = (ROOT / "docs" / "cluster.md").read_text()
    listed = re.search(r"^\s*pip install (.*ray\[default\].*)$", text, re.MULTILINE)
    assert listed, "docs/cluster.md gives no pip line for a node"
    names = {w.strip("'\"").split("==")[0].lower() for w in listed.group(1).split()}
    assert set(node_probe.NODE_PACKAGES.values()) <= names, (names, node_probe.NODE_PACKAGES)
