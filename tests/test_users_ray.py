"""The suite leaves alone a Ray that a user runs on this machine: the ``ray start --head``
cluster up before the first test (``conftest.users_ray``) is up after the last, with all its
processes, and ``ray.init()`` without an address still finds it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.users_ray
def test_a_users_ray_outlives_the_whole_suite(users_ray):
    assert users_ray is not None
    gone = [pid for pid in users_ray["daemons"] if not Path(f"/proc/{pid}").exists()]
    assert not gone, f"the GCS or raylet of the user's Ray ended during the suite: {gone}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # as the user's shell
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ray; ray.init(log_to_driver=False); "
            "print(ray.get_runtime_context().gcs_address)",
        ],
        env={**env, "RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip().splitlines()[-1] == users_ray["address"], found.stdout


@pytest.mark.users_ray
def test_without_an_address_a_run_joins_the_users_ray_and_says_so(users_ray):
    """Ray's rule, as ``raysinga train --help`` states it: with a ``ray start`` cluster on the
    machine and neither --address nor RAY_ADDRESS, a run joins that cluster."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # as the user's shell
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ray; from raysinga.cluster.connect import connect; print(connect()); "
            "ray.shutdown()",
        ],
        env={**env, "RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    want = f"raysinga: Ray: joined the cluster at {users_ray['address']} (the cluster `ray start`"
    assert want in r.stdout, r.stdout
