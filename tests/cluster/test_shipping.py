"""raysinga ships itself: a node whose Python has Ray and raysinga's dependencies but not
raysinga runs the roles of a run that joins its cluster, and without shipping that node is
named in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import node_env, ray_start_cluster

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


@pytest.fixture(scope="module")
def cluster_without_raysinga(node_python):
    """A head without CPUs and one 2-CPU node of ``node_python``: every role runs there."""
    pytest.importorskip("ray").shutdown()  # two clusters at once are too much for two cores
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    with ray_start_cluster([(node_python, 2)], env) as (address, _, _):
        yield address, env


def train(tmp_path: Path, env: dict, *more: str) -> subprocess.CompletedProcess:
    """``raysinga train`` of the digits MLP from a directory outside the repository (a
    driver in the repository would lend its path to the workers on this machine)."""
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "raysinga"),
            "train",
            str(ROOT / "examples" / "digits_mlp.yaml"),
            "--set",
            "train_steps=100",
            "--set",
            f"run_dir={tmp_path}",
            *more,
        ],
        cwd=tmp_path.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def accuracy(out: str) -> float:
    return float(out.split("final test accuracy: ")[1].split()[0])


@pytest.mark.cluster
@pytest.mark.ray_stop
def test_a_node_without_raysinga_trains_the_job_that_ships_it(cluster_without_raysinga, tmp_path):
    address, env = cluster_without_raysinga
    here = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
    alone = train(tmp_path / "alone", here)  # the embedded local Ray of the driver's machine
    assert alone.returncode == 0, alone.stderr
    shipped = train(tmp_path / "shipped", env, "--address", address)
    assert shipped.returncode == 0, shipped.stdout + shipped.stderr
    out = shipped.stdout + shipped.stderr
    assert "Traceback" not in out and "ModuleNotFoundError" not in out, out
    assert accuracy(shipped.stdout) == accuracy(alone.stdout)


@pytest.mark.cluster
@pytest.mark.ray_stop
def test_without_shipping_the_node_that_cannot_import_raysinga_is_named(
    cluster_without_raysinga, node_python, tmp_path
):
    address, env = cluster_without_raysinga
    run = train(tmp_path, env, "--address", address, "--no-ship")
    assert run.returncode == 1, run.stdout + run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("raysinga: error:")]
    assert len(errors) == 1, run.stderr
    assert "cannot import raysinga" in errors[0] and node_python in errors[0], errors
    assert "--no-ship" in errors[0] and "Traceback" not in run.stderr, run.stderr


@pytest.mark.cluster
@pytest.mark.ray_stop
def test_a_node_without_a_dependency_is_named_in_one_line(tmp_path):
    """A node whose Python lacks pyarrow: the run stops before any role, naming the node, the
    module and the remedy, in one line and without a traceback."""
    pytest.importorskip("ray").shutdown()
    lacking = node_env(tmp_path / "node", without=("pyarrow",))
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    with ray_start_cluster([(lacking, 1)], env) as (address, _, _):
        run = train(tmp_path / "run", env, "--address", address)
    assert run.returncode == 1, run.stdout + run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("raysinga: error:")]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr
    assert "cannot import pyarrow" in errors[0] and lacking in errors[0], errors
    assert "pip install pyarrow" in errors[0], errors
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing was started, or written
