"""Session-wide test setup: skip `gpu` tests when no GPU is usable."""

from __future__ import annotations

import gc
import subprocess

import pytest

from raysinga.kernels import gpu_available, gpu_unavailable_reason


def pytest_collection_modifyitems(config, items):
    _ray_stop_last(items)
    if gpu_available():
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {gpu_unavailable_reason()}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _ray_stop_last(items):
    """Multi-node tests replace the session's embedded Ray with a ``Cluster``, and ``ray_stop``
    tests end every Ray on the machine: run them after everything else, in that order, so the
    embedded Ray starts once."""
    items.sort(
        key=lambda item: (
            2 if "ray_stop" in item.keywords else 1 if "cluster" in item.keywords else 0
        )
    )


@pytest.fixture
def ray_session():
    """The embedded Ray shared by the session (``ray.init`` costs seconds), started on first
    use. Eight logical CPUs, so topologies of up to four workers fit a two-core machine."""
    return start_ray()


def start_ray():
    """The session's embedded Ray (module-scoped fixtures call this directly)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    return ray


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs: a disk that fills up (skipped where mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        gc.collect()  # Checkpoints map their shards: let go of them before unmounting
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head with no CPUs and two 2-CPU nodes, on this machine (``ray.cluster_utils``)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()
