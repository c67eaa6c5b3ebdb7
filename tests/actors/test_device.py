"""A GPU worker's device side: uploads through the pinned staging buffer, gradients straight
into the page-locked shared buffer (on a GPU); a spare's warm-up computes a worker's part of the
group's batch and leaves neither state nor, on a GPU, CuPy's cached blocks behind."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from raysinga.actors.common.buffers import Layout, SharedBuffer
from raysinga.actors.common.device import ServerDevice, WorkerDevice, warm
from raysinga.data import BatchPlan
from raysinga.data.splits import open_splits
from raysinga.nn.model import ModelSpec, Net

MODEL = {
    "input_shape": [64],
    "loss": "softmax_cross_entropy",
    "layers": [
        {"kind": "dense", "name": "fc", "units": 32},
        {"kind": "batchnorm", "name": "bn"},
        {"kind": "dense", "name": "out", "units": 10},
    ],
}

SHAPES = {"fc/W": (7, 5), "fc/b": (5,), "empty": (0,)}


def _spare(gpu=None, graphs=None):
    """What :func:`warm` reads of a worker: its net, state, data and batch plan."""
    net = Net(ModelSpec.from_dict(MODEL), dtype="float32")
    train = open_splits({"kind": "digits"}, None).train
    state = net.init_state()
    if gpu is not None:
        state = {k: gpu.asarray(v) for k, v in state.items()}
    seen = []
    real = net.loss_and_grads

    def loss_and_grads(params, state, x, y, ctx, *rest, **kw):
        seen.append(x.shape)
        return real(params, state, x, y, ctx, *rest, **kw)

    net.loss_and_grads = loss_and_grads
    spare = SimpleNamespace(
        net=net,
        state=state,
        seed=0,
        train=train,
        plan=BatchPlan(len(train), 64, 0, True),
        batch_index=lambda step: step,
        group_batch=64,
        gpu=gpu,
        graphs=graphs,
    )
    return spare, seen


def test_a_spares_warm_up_computes_a_workers_part_and_puts_its_state_back():
    spare, seen = _spare()
    before = {k: v.copy() for k, v in spare.state.items()}
    warm(spare, 4)
    assert seen == [(16, 64)]  # a quarter of the group's 64: what each of 4 workers computes
    for k, v in before.items():  # the batch norm's running statistics, as they were
        np.testing.assert_array_equal(spare.state[k], v)


@pytest.mark.gpu
def test_a_gpu_spares_warm_up_leaves_no_cached_blocks_in_cupys_pool():
    """The live roles share the GPU: the warm-up's temporaries go back to it."""
    import cupy

    grads = SharedBuffer("device-warm-test", Layout.of({}))
    shapes = Net(ModelSpec.from_dict(MODEL), dtype="float32").param_shapes()
    dev = WorkerDevice(shapes, "float32", grads)
    try:
        pool = cupy.get_default_memory_pool()
        pool.free_all_blocks()
        spare, seen = _spare(gpu=dev)
        held = pool.used_bytes()
        warm(spare, 2)
        assert seen == [(32, 64)]
        assert pool.total_bytes() - pool.used_bytes() == 0  # nothing cached
        assert pool.used_bytes() <= held + 1024  # nothing but the state's copies, if any
    finally:
        dev.close()
        grads.close()


@pytest.mark.gpu
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


@pytest.mark.gpu
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
