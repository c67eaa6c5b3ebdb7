"""CUDA graphs of a training step: record the step's launches once, replay them at every step.

A step of a small net is a few dozen short kernels, and launching them one by one from Python
costs more host time than the GPU spends on them. A graph replays the whole sequence with one
launch. What a graph needs, and this module gives:

- Memory that stays put. Arrays allocated while the step is recorded come from a memory pool of
  the graph's own, which nothing else allocates from, so a replay writes where the recording
  did and never over another array.
- Values that change from step to step without a new recording: the learning rate, Adam's bias
  corrections, dropout's keys. :class:`StepValues` keeps them in device memory, refreshed from
  pinned host memory by one asynchronous copy ahead of each replay; the kernels read them there.
- Inputs copied into fixed buffers (:class:`Staging`): the batch goes through pinned host memory
  into the device buffers the graph reads.
- Matrix products that can be captured: ``gpu_blas`` (CuPy refuses cuBLAS under capture).

Imports CuPy: only a GPU run with graphs imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import cupy
import numpy as np

from . import gpu_blas

_H2D = cupy.cuda.runtime.memcpyHostToDevice
_D2H = cupy.cuda.runtime.memcpyDeviceToHost


def _pinned(n: int, dtype) -> np.ndarray:
    """``n`` values of ``dtype`` in page-locked host memory (asynchronous copies need it)."""
    dtype = np.dtype(dtype)
    mem = cupy.cuda.alloc_pinned_memory(max(n, 1) * dtype.itemsize)
    return np.frombuffer(mem, dtype, max(n, 1))[:n]


class StepValues:
    """Scalars of the current step in device memory, for kernels that a graph replays.

    ``floats(key, n, fn)`` (float64) and ``ints(key, n, fn)`` (uint64) return a device view of
    ``n`` values that ``fn(step, ctx)`` computes on the host; the first call with a key registers
    ``fn`` and writes its values for the current step, later calls return the same view.
    :meth:`refresh` computes every registered value for a new step and copies them all in one
    asynchronous copy on the current stream, ahead of the replay that reads them.

    The buffers grow as keys are registered (an uncaptured step registers every key of its
    step function: Adam takes 3 values per parameter, so a model of thousands of tensors needs
    more than the first ``capacity``). Growing moves the values, so a key is never registered
    under stream capture: a recording reads the addresses the step before it registered.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._host = {k: _pinned(capacity, k) for k in (np.float64, np.uint64)}
        self._dev = {k: cupy.zeros(capacity, k) for k in (np.float64, np.uint64)}
        self._used = {np.float64: 0, np.uint64: 0}
        self._keys: dict[str, tuple[Any, int, int, Callable]] = {}
        self._done: cupy.cuda.Event | None = None  # the last copy out of the host buffers
        self.step: int | None = None
        self.ctx: Any = None

    def floats(self, key: str, n: int, fn: Callable[[int, Any], Any]) -> cupy.ndarray:
        return self._view(np.float64, key, n, fn)

    def ints(self, key: str, n: int, fn: Callable[[int, Any], Any]) -> cupy.ndarray:
        return self._view(np.uint64, key, n, fn)

    def _view(self, kind, key: str, n: int, fn: Callable) -> cupy.ndarray:
        got = self._keys.get(key)
        if got is None:
            if self.step is None:
                raise RuntimeError("StepValues: refresh(step, ctx) before the step runs")
            if cupy.cuda.get_current_stream().is_capturing():
                raise RuntimeError(
                    f"StepValues: {key!r} was first asked for while a step was being recorded; "
                    "every value must be registered by the uncaptured step before it"
                )
            start = self._used[kind]
            if start + n > self.capacity:
                self._grow(start + n)
            self._used[kind] = start + n
            got = self._keys[key] = (kind, start, n, fn)
            self._wait()
            self._host[kind][start : start + n] = fn(self.step, self.ctx)
            self._copy(kind, start, n)
        kind2, start, n2, _ = got
        if (kind2, n2) != (kind, n):
            raise ValueError(f"StepValues: {key!r} was registered as {n2} x {np.dtype(kind2)}")
        return self._dev[kind][start : start + n]

    def refresh(self, step: int, ctx: Any) -> None:
        """Compute every registered value for ``step`` and copy them to the device."""
        self.step, self.ctx = step, ctx
        self._wait()
        for kind, start, n, fn in self._keys.values():
            self._host[kind][start : start + n] = fn(step, ctx)
        for kind, used in self._used.items():
            if used:
                self._copy(kind, 0, used)

    def _grow(self, need: int) -> None:
        """Room for ``need`` values of each kind: new buffers, the values so far copied over
        (the device's from the host's, which hold the same: every write goes host first)."""
        self._wait()  # the copies out of the old host buffers are done
        cap = max(need, 2 * self.capacity)
        for kind in list(self._host):
            host = _pinned(cap, kind)
            host[: self._used[kind]] = self._host[kind][: self._used[kind]]
            self._host[kind], self._dev[kind] = host, cupy.zeros(cap, kind)
        self.capacity = cap
        for kind, used in self._used.items():
            if used:
                self._copy(kind, 0, used)

    def _wait(self) -> None:
        """The host buffers may be rewritten once the copies out of them have run."""
        if self._done is not None:
            self._done.synchronize()

    def _copy(self, kind, start: int, n: int) -> None:
        stream = cupy.cuda.get_current_stream()
        item = np.dtype(kind).itemsize
        cupy.cuda.runtime.memcpyAsync(
            self._dev[kind].data.ptr + start * item,
            self._host[kind].ctypes.data + start * item,
            n * item,
            _H2D,
            stream.ptr,
        )
        self._done = stream.record()


class Staging:
    """Fixed device buffers for a step's inputs, filled through pinned host memory."""

    def __init__(self, like: list[np.ndarray]) -> None:
        self.host = [_pinned(a.size, a.dtype).reshape(a.shape) for a in like]
        self.dev = [cupy.empty(a.shape, a.dtype) for a in like]
        self._done: cupy.cuda.Event | None = None

    def matches(self, arrays: list[np.ndarray]) -> bool:
        return len(arrays) == len(self.dev) and all(
            a.shape == d.shape and a.dtype == d.dtype for a, d in zip(arrays, self.dev, strict=True)
        )

    def load(self, arrays: list[np.ndarray]) -> list[cupy.ndarray]:
        """Copy ``arrays`` (host, of the staged shapes and dtypes) into the device buffers, on
        the current stream; returns the buffers."""
        if self._done is not None:
            self._done.synchronize()  # the previous step's inputs have left the host buffers
        stream = cupy.cuda.get_current_stream()
        for a, h, d in zip(arrays, self.host, self.dev, strict=True):
            np.copyto(h, a, casting="no")
            cupy.cuda.runtime.memcpyAsync(d.data.ptr, h.ctypes.data, h.nbytes, _H2D, stream.ptr)
        self._done = stream.record()
        return self.dev


class Readback:
    """Small device results of each step (the loss, the gradient norm) copied into a pinned
    ring on the current stream after each replay, and read in one go when the host needs them:
    the steps in between never wait for the GPU."""

    def __init__(self, width: int, depth: int) -> None:
        self.ring = _pinned(width * depth, np.float64).reshape(depth, width)
        self.depth = depth
        self.pending: list[tuple[int, int]] = []  # (step, row)
        self._event: cupy.cuda.Event | None = None

    @property
    def full(self) -> bool:
        return len(self.pending) == self.depth

    def push(self, step: int, values: cupy.ndarray) -> None:
        """Queue a copy of ``values`` (float64, ``width`` of them, fixed) for ``step``."""
        if self.full:
            raise RuntimeError("Readback: drain() before more steps than its depth")
        row = len(self.pending)
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(
            self.ring[row].ctypes.data, values.data.ptr, self.ring[row].nbytes, _D2H, stream.ptr
        )
        self.pending.append((step, row))
        self._event = stream.record()

    def drain(self) -> list[tuple[int, np.ndarray]]:
        """Every queued step with its values, in order; waits for the last copy."""
        if not self.pending:
            return []
        self._event.synchronize()
        out = [(step, self.ring[row].copy()) for step, row in self.pending]
        self.pending.clear()
        return out


def _device_memory(size: int) -> Any:
    """``size`` bytes of device memory, allocated by CUDA (what CuPy's pools allocate with)."""
    return cupy.cuda.MemoryPointer(cupy.cuda.Memory(size), 0)


class RecordingOutOfMemory(MemoryError):
    """The device had no memory for a block a step being recorded asked for. The recorder goes
    on without graphs (:class:`~raysinga.run.graph_step.StepRecorder`): an uncaptured step may
    free the pool's cached blocks, which nothing recorded reads."""


class StepGraph:
    """One step function, recorded as a CUDA graph and replayed.

    ``record(fn)`` runs ``fn()`` under stream capture on a stream of the graph's own, with every
    allocation from the graph's private pool; ``fn`` does on the host what the step does
    (launches, bookkeeping) but the GPU runs nothing until :meth:`replay`. Everything ``fn`` reads
    must already be in device memory at fixed addresses (parameters, staging buffers,
    :class:`StepValues`); it must not read device values back to the host.
    """

    def __init__(self) -> None:
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pool = cupy.cuda.MemoryPool(self._new_block)
        self.graph = None
        self.kept: Any = None  # what the recorded function returned: its outputs stay alive
        self.recording = False

    def _new_block(self, size: int) -> Any:
        """The pool's allocator. Out of device memory while a step is recorded, it raises
        :class:`RecordingOutOfMemory`, which the pool lets through: on CUDA's own error the
        pool would free its cached blocks and try again, and the step recorded so far may
        read and write those blocks at every replay."""
        try:
            return _device_memory(size)
        except cupy.cuda.runtime.CUDARuntimeError as e:
            if self.recording and e.status == cupy.cuda.runtime.errorMemoryAllocation:
                raise RecordingOutOfMemory(
                    f"out of device memory allocating {size:,} bytes while a step was recorded"
                ) from e
            raise

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` uncaptured, on the graph's stream and pool (a warm-up run: kernels are
        compiled and loaded, the pool holds what a step allocates)."""
        with self.stream, cupy.cuda.using_allocator(self.pool.malloc):
            return fn()

    def record(self, fn: Callable[[], Any]) -> None:
        if gpu_blas.import_error() is not None:
            raise RuntimeError(f"CUDA graphs need cuBLAS under capture: {gpu_blas.import_error()}")
        self.stream.synchronize()
        with self.stream, cupy.cuda.using_allocator(self.pool.malloc):
            self.stream.begin_capture()
            self.recording = True
            try:
                kept = fn()
            except BaseException:
                # The capture must end either way; an error of fn's has usually invalidated
                # it, and ending it then raises "capture invalidated", which says nothing of
                # why: fn's own error is the one raised.
                with contextlib.suppress(Exception):
                    self.stream.end_capture()
                raise
            finally:
                self.recording = False
            graph = self.stream.end_capture()
        self.graph, self.kept = graph, kept

    def replay(self) -> None:
        self.graph.launch(stream=self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()
