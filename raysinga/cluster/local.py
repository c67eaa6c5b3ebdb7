"""A multi-node Ray cluster on one machine, for the node-loss demo, benchmarks and tests, that
leaves the machine's own Ray as it found it.

Ray's ``cluster_utils.Cluster`` writes its head's address into the file where ``ray.init()``
and ``ray status`` look for the cluster ``ray start`` runs on this machine, and deletes that
file when it shuts down: a user's own cluster would no longer be found. The file is put back
as it was as soon as the head is up, and again at the end.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def local_cluster(
    *node_cpus: int, node_gpus: int = 0, **head: Any
) -> Iterator[tuple[Any, list[Any]]]:
    """A head with no CPUs (plus ``head``: options of ``Cluster``'s head node) and one node per
    entry of ``node_cpus``, each with ``node_gpus`` GPUs (the machine's own, shared by the
    nodes), this process's Ray joined to it; yields the ``Cluster`` and its nodes. Any Ray this
    process had initialized is shut down first."""
    import ray  # noqa: PLC0415
    from ray.cluster_utils import Cluster  # noqa: PLC0415

    ray.shutdown()
    saved = _address_file()
    head = {"num_cpus": 0, "num_gpus": 0, **head}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        _put_back(saved)
        gpus = {"num_gpus": node_gpus} if node_gpus else {}
        nodes = [cluster.add_node(num_cpus=n, **gpus) for n in node_cpus]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster, nodes
    finally:
        ray.shutdown()
        # the cluster is thrown away: its processes are killed outright. A graceful stop waits
        # up to a second for each process of each node, and Ray's GCS server ignores SIGTERM
        for node in [*cluster.worker_nodes, cluster.head_node]:
            if node is not None:
                cluster.remove_node(node, allow_graceful=False)
        cluster.shutdown()  # Ray's records of the cluster's address
        _put_back(saved)


def address_file() -> str:
    """Where ``ray start`` leaves its address for ``ray.init()`` and ``ray status``."""
    try:
        from ray._common.utils import get_ray_address_file  # noqa: PLC0415
    except ImportError:  # Ray moved it: its documented default place
        return "/tmp/ray/ray_current_cluster"
    return get_ray_address_file(None)


def _address_file() -> tuple[str, str | None]:
    path = address_file()
    try:
        with open(path) as f:
            return path, f.read()
    except OSError:
        return path, None


def _put_back(saved: tuple[str, str | None]) -> None:
    path, text = saved
    with contextlib.suppress(OSError):
        if text is None:
            os.remove(path)
        else:
            with open(path, "w") as f:
                f.write(text)
