"""Roles spread over several nodes: data crosses through the object store, not shared memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from raysinga import config
from raysinga.actors.cluster import packs, shrunk
from raysinga.actors.topology import Resources, Topology
from raysinga.distributed import DistributedTrainer
from raysinga.kernels.cpu_threads import BLAS_ENV
from raysinga.trainer import Trainer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def job(tmp_path, topology):
    return config.load(
        EXAMPLES / "digits_mlp.yaml",
        [
            "train_steps=30",
            "disp_freq=15",
            "test_freq=0",
            f"run_dir={tmp_path}",
            f"topology={topology}",
        ],
    )


@pytest.mark.cluster
def test_a_group_split_over_two_nodes_matches_the_reference(two_node_cluster, tmp_path):
    # Two workers of two CPUs each cannot share a 2-CPU node; a server rides with each worker,
    # so every worker reads one server locally and the other through a snapshot.
    topo = "{workers_per_group: 2, n_servers: 2, slice_bytes: 8192, worker: {cpus: 2}}"
    trainer = DistributedTrainer(job(tmp_path / "d", topo), log=lambda s: None)
    params = trainer.fit().params
    ref = Trainer(job(tmp_path / "r", "null"), log=lambda s: None).fit().params
    for k in ref:
        assert np.abs(params[k] - ref[k]).max() <= 1e-5 * np.abs(ref[k]).max(), k


@pytest.mark.cluster
def test_downpour_groups_on_different_nodes_train(two_node_cluster, tmp_path):
    topo = "{preset: downpour, n_groups: 2, workers_per_group: 1, staleness: 2, worker: {cpus: 2}}"
    cfg = config.load(
        EXAMPLES / "digits_mlp.yaml",
        ["train_steps=300", "disp_freq=100", f"run_dir={tmp_path}", f"topology={topo}"],
    )
    result = DistributedTrainer(cfg, log=lambda s: None).fit()
    assert result.final_eval["test_accuracy"] >= 0.9


def test_shrunk_lists_smaller_topologies_fewer_workers_first():
    t = Topology(preset="downpour", n_groups=2, workers_per_group=3)
    got = [(s.n_groups, s.workers_per_group) for s in shrunk(t, 1, 2)]
    assert got == [(2, 3), (2, 2), (1, 3), (1, 2)]
    assert shrunk(t, 2, 3) == [t]


def test_packs_checks_every_bundle_against_some_node():
    two = Topology(workers_per_group=2)  # two 1-CPU worker bundles; server and stub ride along
    assert packs(two, [{"CPU": 2.0}])
    assert packs(two, [{"CPU": 1.0}, {"CPU": 1.0}])
    assert not packs(two, [{"CPU": 1.0}, {"CPU": 0.5}])  # 1.5 CPUs, but no half bundles
    gpu = Topology(workers_per_group=2, worker=Resources(cpus=1, gpus=0.5))
    assert packs(gpu, [{"CPU": 2.0, "GPU": 1.0}])
    assert not packs(gpu, [{"CPU": 4.0}])
    own = Topology(workers_per_group=1, server=Resources(cpus=2))  # a server bundle of its own
    assert not packs(own, [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}])
    assert packs(own, [{"CPU": 1.0}, {"CPU": 2.0}])


def test_process_env_adds_only_what_is_unset_and_restores(monkeypatch):
    from raysinga.actors.cluster import _process_env

    monkeypatch.setenv("RAYSINGA_TEST_KEPT", "mine")
    monkeypatch.delenv("RAYSINGA_TEST_ADDED", raising=False)
    with _process_env({"RAYSINGA_TEST_KEPT": "theirs", "RAYSINGA_TEST_ADDED": "1"}):
        assert os.environ["RAYSINGA_TEST_KEPT"] == "mine"
        assert os.environ["RAYSINGA_TEST_ADDED"] == "1"
    assert os.environ["RAYSINGA_TEST_KEPT"] == "mine"
    assert "RAYSINGA_TEST_ADDED" not in os.environ


def test_the_embedded_rays_roles_start_with_the_blas_settings(tmp_path):
    """OpenBLAS reads its settings once, as it loads: a role's process must start with them."""
    script = (
        "import os, ray\n"
        "from raysinga.actors import cluster\n"
        "print(cluster.connect('local'))\n"
        "print(cluster.connect('local'))\n"
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
