"""The GPU side of workers and servers: their arrays stay on the device between steps.

Each step a role uploads host arrays (a worker the servers' values, a server the summed gradient)
through one pinned (page-locked) staging buffer, allocated once and reused, and writes its results
straight from the device into its own shared buffer (a worker's gradients, a server's values),
whose pages are locked for the role's life so the copy is a direct DMA. All copies are queued on
the stream the kernels run on, so they are ordered with the compute; a role waits once per step,
after the last array is down.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from raysinga.kernels import cupy_module

from .buffers import Layout, SharedBuffer


class _Transfers:
    """A pinned staging buffer laid out as ``stage`` for uploads, and the shared buffer ``down``
    with its pages locked for downloads."""

    def __init__(self, stage: Layout, down: SharedBuffer) -> None:
        self.cp = cupy_module()  # a clear error where CuPy cannot use a GPU
        import cupyx  # noqa: PLC0415 - with CuPy

        self._cupyx = cupyx
        self._stage = cupyx.empty_pinned((max(stage.nbytes, 1),), np.uint8)
        self.staged = stage.views(self._stage)
        self.down = down
        self._locked = 0
        if down.layout.nbytes:
            self.cp.cuda.runtime.hostRegister(down.flat.ctypes.data, down.layout.nbytes, 0)
            self._locked = down.flat.ctypes.data

    def _upload(self, host: dict[str, np.ndarray], dev: dict[str, Any]) -> dict[str, Any]:
        """``dev`` refreshed from ``host`` through the staging buffer; asynchronous."""
        stream = self.cp.cuda.get_current_stream()
        for k, a in host.items():
            np.copyto(self.staged[k], a)
            dev[k].set(self.staged[k], stream=stream)
        return dev

    def _download(self, dev: dict[str, Any]) -> None:
        """Device arrays into the shared buffer's arrays of the same names; returns once they
        are there."""
        stream = self.cp.cuda.get_current_stream()
        for k, a in dev.items():
            a.get(stream=stream, out=self.down.arrays[k], blocking=False)
        stream.synchronize()

    def close(self) -> None:
        """Unlock the shared buffer's pages (before the buffer is unmapped)."""
        if self._locked:
            self.cp.cuda.runtime.hostUnregister(self._locked)
            self._locked = 0


class WorkerDevice(_Transfers):
    """Device copies of a worker's parameters, and the transfers of one step; the gradients go
    down into the worker's shared gradient buffer."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: str, grads: SharedBuffer) -> None:
        super().__init__(Layout.of({p: (s, dtype) for p, s in shapes.items()}), grads)
        self.params = {p: self.cp.empty(s, dtype) for p, s in shapes.items()}

    def asarray(self, a: Any) -> Any:
        return self.cp.asarray(a)

    def upload(self, params: dict[str, np.ndarray]) -> dict[str, Any]:
        """The device copies of ``params`` (host arrays), refreshed; asynchronous."""
        return self._upload(params, self.params)

    def download_grads(self, grads: dict[str, Any]) -> None:
        """Device gradients into the shared gradient buffer; returns once they are there."""
        self._download(grads)


class ServerDevice(_Transfers):
    """A server that runs its optimizer on a GPU: its slices and their optimizer slots live on
    the device, the summed gradient goes up through the staging buffer, and the new values come
    down into the shared buffer the workers read.

    A checkpoint's snapshot of the slots is copied to pinned host buffers on a stream of its own,
    ordered after the last update; the next update waits for that copy on the device, not on the
    host, and the checkpoint writer waits for it before it reads the copies."""

    def __init__(self, layout: Layout, buf: SharedBuffer) -> None:
        super().__init__(layout, buf)
        self.values = {e.name: self.cp.asarray(buf.arrays[e.name]) for e in layout.entries}
        self.grads = {k: self.cp.empty_like(v) for k, v in self.values.items()}
        self._copier = self.cp.cuda.Stream(non_blocking=True)
        # pinned host copies of the slots, reused from one snapshot on: one set for the
        # checkpoints' snapshots, one for the copies a lost server is rebuilt from
        self._slot_copies: dict[str, dict[str, np.ndarray]] = {"checkpoints": {}, "copies": {}}
        self._copied: Any = None  # the event the last snapshot's copy records

    def reload(self) -> None:
        """The device values from the shared buffer (after a checkpoint was loaded into it)."""
        for k, v in self.values.items():
            v.set(self.down.arrays[k])

    def upload_grads(self, grads: dict[str, np.ndarray]) -> dict[str, Any]:
        if self._copied is not None:  # a snapshot's copy of the slots comes before the update
            self.cp.cuda.get_current_stream().wait_event(self._copied)
            self._copied = None
        return self._upload(grads, self.grads)

    def publish(self) -> None:
        """The updated values into the shared buffer; returns once they are there."""
        self._download(self.values)

    def snapshot_slots(
        self, slots: dict[str, Any], into: str = "checkpoints"
    ) -> tuple[dict[str, np.ndarray], Any]:
        """Start copying optimizer slots (device arrays by key) to pinned host memory (the set
        named ``into``: ``checkpoints`` or ``copies``, whose readers each wait for their own);
        returns the host arrays and an event that is complete once they hold the values."""
        after_update = self.cp.cuda.get_current_stream().record()
        self._copier.wait_event(after_update)
        out, cache = {}, self._slot_copies[into]
        for key, a in slots.items():
            host = cache.get(key)
            if host is None or host.shape != a.shape or host.dtype != a.dtype:
                host = cache[key] = self._cupyx.empty_pinned(a.shape, a.dtype)
            if isinstance(a, np.ndarray):  # loaded, not yet moved to the device by an update
                np.copyto(host, a)
            else:
                a.get(stream=self._copier, out=host, blocking=False)
            out[key] = host
        self._copied = self._copier.record()
        return out, self._copied


def warm(worker: Any, parts: int = 1) -> float:
    """A GPU worker's spare: run one training step of the model's initial parameters on the
    run's first batch (the first of ``parts`` parts of the group's batch: the shape a worker
    of the group computes), so that its kernels are compiled and loaded before it takes over.
    Nothing of the step stays: the state is put back and the gradients are dropped.

    Nor does its memory stay where no step will use it. With CUDA graphs the step runs as the
    graph's first, uncaptured step (:class:`~raysinga.run.graph_step.WorkerGraphStep`), in the
    pool the graph is then recorded in: the adopted spare's first real step of that shape is
    the recording, with no second pool grown. Without graphs the blocks CuPy's pool cached
    for the step are given back to the GPU the live roles share. Returns the seconds taken."""
    from raysinga.nn.layers import StepContext  # noqa: PLC0415

    t0 = time.perf_counter()
    kept = {k: v.copy() for k, v in worker.state.items()}
    params = worker.net.init_params(worker.seed)
    x, y = worker.train.get(worker.plan.indices(worker.batch_index(0), 0, max(parts, 1)))
    ctx = StepContext(train=True, seed=worker.seed, step=0, sample_offset=0)
    if worker.graphs is not None:
        worker.graphs.step(0, ctx, x, y, params)  # into its own gradient buffer: unread
    else:
        x = worker.net.prepare_input(x)
        if worker.gpu is not None:
            params = worker.gpu.upload(params)
            x, y = worker.gpu.asarray(x), worker.gpu.asarray(y)
        worker.net.loss_and_grads(params, worker.state, x, y, ctx, worker.group_batch)
    for k, v in kept.items():
        worker.state[k][...] = v
    if worker.gpu is not None:
        cp = worker.gpu.cp
        cp.cuda.get_current_stream().synchronize()
        del x, y, params
        if worker.graphs is None:
            cp.get_default_memory_pool().free_all_blocks()
    return time.perf_counter() - t0
