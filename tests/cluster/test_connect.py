"""Joining Ray or starting an embedded one: the environment its processes start with, and the
line that says which Ray a run uses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from raysinga.cluster.connect import _process_env
from raysinga.kernels.cpu_threads import BLAS_ENV


def test_process_env_adds_only_what_is_unset_and_restores(monkeypatch):
    monkeypatch.setenv("RAYSINGA_TEST_KEPT", "mine")
    monkeypatch.delenv("RAYSINGA_TEST_ADDED", raising=False)
    with _process_env({"RAYSINGA_TEST_KEPT": "theirs", "RAYSINGA_TEST_ADDED": "1"}):
        assert os.environ["RAYSINGA_TEST_KEPT"] == "mine"
        assert os.environ["RAYSINGA_TEST_ADDED"] == "1"
    assert os.environ["RAYSINGA_TEST_KEPT"] == "mine"
    assert "RAYSINGA_TEST_ADDED" not in os.environ


@pytest.mark.slow  # a Ray of its own: 13 s
def test_the_embedded_rays_roles_start_with_the_blas_settings(tmp_path):
    """OpenBLAS reads its settings once, as it loads: a role's process must start with them."""
    script = (
        "import os, ray\n"
        "from raysinga.cluster.connect import connect\n"
        "print(connect('local'))\n"
        "print(connect('local'))\n"
        "@ray.remote(num_cpus=0)\n"
        "def env():\n"
        "    return os.environ.get('OPENBLAS_THREAD_TIMEOUT')\n"
        "driver = os.environ.get('OPENBLAS_THREAD_TIMEOUT')\n"
        "print('role', ray.get(env.remote()), 'driver', driver)\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env["RAY_ADDRESS"] = "local"
    r = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    want = BLAS_ENV["OPENBLAS_THREAD_TIMEOUT"]
    assert f"role {want} driver None" in r.stdout
    # the line a run prints: which Ray it uses
    assert "raysinga: Ray: started an embedded local Ray (" in r.stdout
    assert "raysinga: Ray: the one this process already uses (" in r.stdout
