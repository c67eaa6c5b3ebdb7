"""Session-wide test setup: skip `gpu` tests when no GPU is usable."""

from __future__ import annotations

import pytest

from raysinga.kernels import gpu_available, gpu_unavailable_reason


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {gpu_unavailable_reason()}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_session():
    """One embedded Ray for the whole session (``ray.init`` costs seconds). Eight logical CPUs,
    so that topologies of up to four workers fit on a two-core machine."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
