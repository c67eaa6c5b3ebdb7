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


class ServerDevice:
    """A server that runs its optimizer on a GPU: its slices and their optimizer slots live on
    the device, the summed gradient goes up through a reused pinned staging buffer, and the new
    values come down into the shared buffer the workers read (its pages locked, a direct DMA).

    A checkpoint's snapshot of the slots is copied to pinned host buffers on a stream of its own,
    ordered after the last update; the next update waits for that copy on the device, not on the
    host, and the checkpoint writer waits for it before it reads the copies."""

    def __init__(self, layout: Layout, buf: SharedBuffer) -> None:
        self.cp = cp = cupy_module()
        import cupyx  # noqa: PLC0415 - with CuPy

        self._cupyx = cupyx
        self.values = {k: cp.asarray(a) for k, a in buf.arrays.items()}
        self._stage = cupyx.empty_pinned((max(layout.nbytes, 1),), np.uint8)
        self.staged = layout.views(self._stage)
        self.grads = {k: cp.empty_like(v) for k, v in self.values.items()}
        self.buf = buf
        self._locked = 0
        if layout.nbytes:
            cp.cuda.runtime.hostRegister(buf.flat.ctypes.data, layout.nbytes, 0)
            self._locked = buf.flat.ctypes.data
        self._copier = cp.cuda.Stream(non_blocking=True)
        self._slot_copies: dict[str, np.ndarray] = {}  # pinned, reused from one snapshot on
        self._copied: Any = None  # the event the last snapshot's copy records

    def reload(self) -> None:
        """The device values from the shared buffer (after a checkpoint was loaded into it)."""
        for k, v in self.values.items():
            v.set(self.buf.arrays[k])

    def upload_grads(self, grads: dict[str, np.ndarray]) -> dict[str, Any]:
        stream = self.cp.cuda.get_current_stream()
        if self._copied is not None:  # a snapshot's copy of the slots comes before the update
            stream.wait_event(self._copied)
            self._copied = None
        for k, host in grads.items():
            np.copyto(self.staged[k], host)
            self.grads[k].set(self.staged[k], stream=stream)
        return self.grads

    def publish(self) -> None:
        """The updated values into the shared buffer; returns once they are there."""
        stream = self.cp.cuda.get_current_stream()
        for k, v in self.values.items():
            v.get(stream=stream, out=self.buf.arrays[k], blocking=False)
        stream.synchronize()

    def snapshot_slots(self, slots: dict[str, Any]) -> tuple[dict[str, np.ndarray], Any]:
        """Start copying optimizer slots (device arrays by key) to pinned host memory; returns
        the host arrays and an event that is complete once they hold the values."""
        after_update = self.cp.cuda.get_current_stream().record()
        self._copier.wait_event(after_update)
        out = {}
        for key, a in slots.items():
            host = self._slot_copies.get(key)
            if host is None or host.shape != a.shape or host.dtype != a.dtype:
                host = self._slot_copies[key] = self._cupyx.empty_pinned(a.shape, a.dtype)
            if isinstance(a, np.ndarray):  # loaded, not yet moved to the device by an update
                np.copyto(host, a)
            else:
                a.get(stream=self._copier, out=host, blocking=False)
            out[key] = host
        self._copied = self._copier.record()
        return out, self._copied

    def close(self) -> None:
        if self._locked:
            self.cp.cuda.runtime.hostUnregister(self._locked)
            self._locked = 0
