"""What raysinga ships of itself to a node that lacks it: one package, assembled once per
content, that holds the roles and the kernel sources. The nodes that run it, and those named
without it, are emulated hosts (tests/cluster/test_submit.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from raysinga.cluster import shipping

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
