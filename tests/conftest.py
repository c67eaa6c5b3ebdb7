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
