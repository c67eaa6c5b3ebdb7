"""CUDA graph recording (kernels/gpu_graph.py) on a GPU: a step function that fails while it is
recorded raises its own error, not the "capture invalidated" of ending the capture it broke; the
step values grow past their first capacity (a model of thousands of Adam tensors) and refuse a
key first asked for under capture; a parameter that is not contiguous takes the fused update in
a recorded step, bit-identical to the update of an uncaptured step."""

from __future__ import annotations

import numpy as np
import pytest

from raysinga import kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not kernels.gpu_available(), reason=f"no usable GPU: {kernels.gpu_unavailable_reason()}"
    ),
]


def test_a_recording_that_fails_raises_the_step_functions_own_error():
    import cupy  # noqa: PLC0415

    from raysinga.kernels.gpu_graph import StepGraph  # noqa: PLC0415

    graph = StepGraph()

    def waits():  # a wait on the stream that records is refused, and breaks the capture
        cupy.ones(3) * 2
        graph.stream.synchronize()

    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError) as caught:
        graph.record(waits)
    # the refusal itself, not ending the capture it broke ("cudaErrorStreamCaptureInvalidated")
    assert "CaptureInvalidated" not in str(caught.value), caught.value

    def fails():
        cupy.ones(3) * 2
        raise ValueError("the step's own error")

    with pytest.raises(ValueError, match="the step's own error"):
        graph.record(fails)
    assert graph.graph is None
    graph.record(lambda: cupy.ones(3) * 2)  # the stream records again after both
    graph.replay()
    graph.synchronize()


def test_step_values_grow_past_their_capacity_and_keep_every_value():
    """Adam registers 3 values per tensor: 1,500 tensors are 4,500 values, past the first
    4,096 (which raised before)."""
    import cupy  # noqa: PLC0415

    from raysinga.kernels.gpu_graph import StepValues  # noqa: PLC0415

    values = StepValues(capacity=8)
    values.refresh(3, None)
    views = [values.floats(f"k{i}", 3, lambda s, _, i=i: (s, i, -i)) for i in range(1500)]
    assert values.capacity >= 4500
    got = cupy.asnumpy(cupy.concatenate([values.floats(f"k{i}", 3, None) for i in range(1500)]))
    want = np.array([(3, i, -i) for i in range(1500)], np.float64).reshape(-1)
    np.testing.assert_array_equal(got, want)
    values.refresh(4, None)
    got = cupy.asnumpy(values.floats("k1499", 3, None))
    np.testing.assert_array_equal(got, [4, 1499, -1499])
    del views


def test_a_step_value_first_asked_for_under_capture_is_refused_by_name():
    from raysinga.kernels.gpu_graph import StepGraph, StepValues  # noqa: PLC0415

    graph, values = StepGraph(), StepValues()
    with graph.stream:
        values.refresh(1, None)
    with pytest.raises(RuntimeError, match="'late' was first asked for while a step was being"):
        graph.record(lambda: values.floats("late", 1, lambda s, _: [s]))


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_a_view_takes_the_fused_update_in_a_recorded_step_bit_identical_to_uncaptured(name):
    """Adam refused a parameter that is not contiguous under a recording; it is updated through
    contiguous copies, which the graph replays too."""
    import cupy  # noqa: PLC0415

    from raysinga.kernels.gpu_graph import StepGraph, StepValues  # noqa: PLC0415
    from raysinga.optim.optimizers import make_optimizer  # noqa: PLC0415

    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(24, 16)).astype(np.float32)
    grads = [rng.normal(size=(16, 24)).astype(np.float32) for _ in range(4)]
    spec = {"name": name, "lr": 0.01, **({"momentum": 0.9} if name == "sgd" else {})}

    plain, opt = make_optimizer(spec), make_optimizer(spec)
    a = cupy.asarray(w0).T  # a view: not C-contiguous
    for step, g in enumerate(grads):
        plain.update(step, "w", a, cupy.asarray(g))

    graph, values = StepGraph(), StepValues()
    b = cupy.asarray(w0).T
    g_dev = cupy.empty((16, 24), np.float32)
    cupy.cuda.get_current_stream().synchronize()
    for step, g in enumerate(grads):
        with graph.stream:
            values.refresh(step, None)
            g_dev.set(g, stream=graph.stream)
        if step == 0:
            graph.run(lambda s=step: opt.update(s, "w", b, g_dev, values=values))
        elif step == 1:
            graph.record(lambda s=step: opt.update(s, "w", b, g_dev, values=values))
            graph.replay()
        else:
            graph.replay()
            opt.advance(["w"])
    graph.synchronize()
    assert not b.flags.c_contiguous
    np.testing.assert_array_equal(cupy.asnumpy(a), cupy.asnumpy(b))


def test_out_of_memory_while_recording_frees_none_of_the_pools_cached_blocks(monkeypatch):
    """CuPy's pool, on CUDA's out-of-memory error, frees its cached blocks and tries again: a
    step recorded so far may use them at every replay. The recording fails instead, and the
    blocks stay."""
    import cupy  # noqa: PLC0415

    from raysinga.kernels import gpu_graph  # noqa: PLC0415

    graph = gpu_graph.StepGraph()

    def step(n):
        return (cupy.ones(n, np.float32) * 2).sum()  # temporaries: cached once freed

    graph.run(lambda: step(1 << 20))
    graph.synchronize()
    cached = graph.pool.total_bytes()
    assert graph.pool.free_bytes() > 0

    def no_memory(size):
        raise cupy.cuda.runtime.CUDARuntimeError(cupy.cuda.runtime.errorMemoryAllocation)

    monkeypatch.setattr(gpu_graph, "_device_memory", no_memory)
    with pytest.raises(gpu_graph.RecordingOutOfMemory, match="while a step was recorded"):
        graph.record(lambda: (step(1 << 20), step(1 << 24)))  # the second needs a new block
    assert graph.pool.total_bytes() == cached and graph.graph is None
    assert not graph.recording
