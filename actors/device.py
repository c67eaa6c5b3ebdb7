"""The GPU side of a worker: parameters and activations stay on the device between steps.

Each step the worker uploads the servers' current values through one pinned (page-locked) staging
buffer, allocated once and reused, and writes its gradients straight from the device into its
shared gradient buffer, whose pages are locked for the worker's life so the copy is a direct DMA.
All copies are queued on the stream the kernels run on, so they are ordered with the compute; the
worker waits once per step, after the last gradient is down.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raysinga.kernels import cupy_module

from .buffers import Layout, SharedBuffer


class WorkerDevice:
    """Device copies of a worker's parameters, and the transfers of one step."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: str, grads: SharedBuffer) -> None:
        self.cp = cp = cupy_module()  # a clear error where CuPy cannot use a GPU
        import cupyx  # noqa: PLC0415 - with CuPy

        layout = Layout.of({p: (s, dtype) for p, s in shapes.items()})
        self._stage = cupyx.empty_pinned((max(layout.nbytes, 1),), np.uint8)
        self.staged = layout.views(self._stage)
        self.params = {p: cp.empty(s, dtype) for p, s in shapes.items()}
        self.grads = grads
        self._locked = 0
        if grads.layout.nbytes:
            cp.cuda.runtime.hostRegister(grads.flat.ctypes.data, grads.layout.nbytes, 0)
            self._locked = grads.flat.ctypes.data

    def asarray(self, a: Any) -> Any:
        return self.cp.asarray(a)

    def upload(self, params: dict[str, np.ndarray]) -> dict[str, Any]:
        """The device copies of ``params`` (host arrays), refreshed; asynchronous."""
        stream = self.cp.cuda.get_current_stream()
        for k, host in params.items():
            np.copyto(self.staged[k], host)
            self.params[k].set(self.staged[k], stream=stream)
        return self.params

    def download_grads(self, grads: dict[str, Any]) -> None:
        """Device gradients into the shared gradient buffer; returns once they are there."""
        stream = self.cp.cuda.get_current_stream()
        for k, g in grads.items():
            g.get(stream=stream, out=self.grads.arrays[k], blocking=False)
        stream.synchronize()

    def close(self) -> None:
        """Unlock the gradient buffer's pages (before the buffer is unmapped)."""
        if self._locked:
            self.cp.cuda.runtime.hostUnregister(self._locked)
            self._locked = 0
