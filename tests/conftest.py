"""Session-wide test setup: skip `gpu` tests when no GPU is usable."""

from __future__ import annotations

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
    """Tests marked ``ray_stop`` run `ray stop`, which ends every Ray on the machine: run them
    after everything else, so the session's embedded Ray is started once."""
    items.sort(key=lambda item: "ray_stop" in item.keywords)


@pytest.fixture
def ray_session():
    """The embedded Ray shared by the session (``ray.init`` costs seconds), started on first
    use. Eight logical CPUs, so topologies of up to four workers fit a two-core machine."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    return ray
