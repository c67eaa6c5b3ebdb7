"""A GPU worker's device side: uploads through the pinned staging buffer, gradients straight
into the page-locked shared buffer (runs only where a GPU is usable)."""

from __future__ import annotations

import numpy as np
import pytest

from raysinga.actors.buffers import Layout, SharedBuffer
from raysinga.actors.device import ServerDevice, WorkerDevice

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


def test_server_device_updates_publish_and_snapshot_slots():
    import cupy

    layout = Layout.of({"w": ((1000,), "float32"), "b": ((10,), "float32")})
    buf = SharedBuffer("device-server-test", layout)
    rng = np.random.default_rng(1)
    for a in buf.arrays.values():
        a[...] = rng.standard_normal(a.shape)
    dev = ServerDevice(layout, buf)
    try:
        host = {k: rng.standard_normal(a.shape).astype(np.float32) for k, a in buf.arrays.items()}
        g = dev.upload_grads(host)
        for k in host:
            dev.values[k] -= 0.5 * g[k]
        want = {k: dev.values[k].get() for k in host}
        dev.publish()
        for k in host:
            assert buf.arrays[k].tobytes() == want[k].tobytes()
        slots = {"w/m": cupy.arange(1000, dtype=cupy.float32), "b/m": np.ones(10, np.float32)}
        copies, done = dev.snapshot_slots(slots)
        dev.upload_grads(host)  # the next update: its stream waits for the copy on the device
        slots["w/m"] += 1  # so this lands after the copy, which keeps the old values
        done.synchronize()
        np.testing.assert_array_equal(copies["w/m"], np.arange(1000, dtype=np.float32))
        np.testing.assert_array_equal(copies["b/m"], np.ones(10, np.float32))
        buf.arrays["w"][...] = 7
        dev.reload()
        assert float(dev.values["w"][0]) == 7.0
    finally:
        dev.close()
        buf.close()
