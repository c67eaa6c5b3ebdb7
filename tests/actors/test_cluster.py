"""Roles spread over several nodes: data crosses through the object store, not shared memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from raysinga import config
from raysinga.distributed import DistributedTrainer
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
