"""CUDA graph recording (kernels/gpu_graph.py) on a GPU: a step function that fails while it is
recorded raises its own error, not the "capture invalidated" of ending the capture it broke."""

from __future__ import annotations

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
