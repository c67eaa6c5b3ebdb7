"""A GPU worker's device side: uploads through the pinned staging buffer, gradients straight
into the page-locked shared buffer (runs only where a GPU is usable)."""

from __future__ import annotations

import numpy as np
import pytest

from raysinga.actors.buffers import Layout, SharedBuffer
from raysinga.actors.device import WorkerDevice

pytestmark = pytest.mark.gpu

SHAPES = {"fc/W": (7, 5), "fc/b": (5,), "empty": (0,)}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_upload_and_download_round_trip(dtype):
    grads = SharedBuffer("device-test", Layout.of({p: (s, dtype) for p, s in SHAPES.items()}))
    dev = WorkerDevice(SHAPES, dtype, grads)
    try:
        rng = np.random.default_rng(0)
        for step in range(3):  # the staging buffer and the device arrays are reused
            host = {p: rng.standard_normal(s).astype(dtype) for p, s in SHAPES.items()}
            on_dev = dev.upload(host)
            assert all(type(a).__module__.startswith("cupy") for a in on_dev.values())
            for p in SHAPES:
                np.testing.assert_array_equal(on_dev[p].get(), host[p])
            dev.download_grads({p: a * (step + 2) for p, a in on_dev.items()})
            for p in SHAPES:
                assert grads.arrays[p].tobytes() == (host[p] * (step + 2)).tobytes()
    finally:
        dev.close()
        dev.close()  # twice is harmless
        grads.close()
