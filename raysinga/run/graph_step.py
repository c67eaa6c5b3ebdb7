"""The single-process trainer's GPU step as a CUDA graph: recorded once per input shape, replayed.

A step (forward, loss, backward, clipping, the optimizer's update) is run uncaptured first, on
the graph's stream and memory pool, so that every kernel is compiled and the pool holds what a
step allocates; the next step is recorded and replayed; every later step of that shape is one
replay. What changes from step to step lives in device memory (``kernels.gpu_graph``): the batch
(copied into fixed buffers through pinned memory), the learning rate and Adam's bias
corrections, dropout's keys. The loss and the gradient norm go into a pinned ring that the host
reads every few steps (:meth:`GraphStep.results`), so no step waits for the GPU.

Whether a run uses graphs: the job's ``gpu.graphs`` (default false), overridden by the
environment variable ``RAYSINGA_GPU_GRAPHS`` (``1`` or ``0``; ``uncaptured`` runs the graphs'
code without recording, the reference a recorded run matches bit for bit; ``strict`` makes a
step that cannot be recorded an error). A step that cannot
be recorded (an op that reads a device value back, or sorts through Thrust, which
synchronises) is reported once, in one line naming the cause, and the run goes on uncaptured
with the same code, so with the same bits.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from raysinga.kernels import precision
from raysinga.optim.grads import clip_grad_norm_on_device

ENV = "RAYSINGA_GPU_GRAPHS"
# Steps whose loss and gradient norm wait in the pinned ring before the host reads them: the
# divergence guard sees a step at most this many steps late (and always before a checkpoint).
DEPTH = 32


def graphs_mode(job_setting: bool) -> str:
    """``"on"``, ``"off"``, ``"strict"`` (on, and a step that cannot be recorded is an error,
    not a notice: for tests) or ``"uncaptured"`` (the graphs' code, run step by step without
    recording: the reference a recorded run must match bit for bit): the job's ``gpu.graphs``
    unless ``RAYSINGA_GPU_GRAPHS`` (``1``, ``0``, ``strict`` or ``uncaptured``) says otherwise."""
    env = os.environ.get(ENV, "").strip().lower()
    if env in ("", "auto"):
        return "on" if job_setting else "off"
    if env in ("1", "true", "on", "yes"):
        return "on"
    if env in ("0", "false", "off", "no"):
        return "off"
    if env in ("uncaptured", "strict"):
        return env
    raise ValueError(f"{ENV} must be 1, 0, strict or uncaptured (or unset), got {env!r}")


class StepRecorder:
    """Runs a step function on the GPU through CUDA graphs, one graph per input shape.

    :meth:`step` stages the host inputs, refreshes the step values and then, by the step's
    place in its shape's run: runs the function uncaptured (the shape's first step, a warm-up),
    records and replays it (the second), or replays the graph (every later one). Where a
    recording fails, the run goes on uncaptured with the same function, and one notice says why.
    """

    def __init__(self, notice: Callable[[str], None], mode: str = "on") -> None:
        from raysinga.kernels import cupy_module, gpu_blas, gpu_graph  # noqa: PLC0415 - CuPy

        if mode not in ("on", "strict", "uncaptured"):
            raise ValueError(f"StepRecorder: mode must be on, strict or uncaptured, got {mode!r}")

        error = gpu_blas.usable_error()  # a missing cuBLAS fails here, not in the first step
        if error is not None:
            raise RuntimeError(f"gpu.graphs: {error}; pip install 'raysinga[gpu]'")
        gpu_blas.use(True)
        self.cupy, self.gg, self.notice = cupy_module(), gpu_graph, notice
        self.values = gpu_graph.StepValues()
        self.graph: Any = None
        self.staging: Any = None
        self.shape_key: tuple | None = None
        self.recorded = False
        self.strict = mode == "strict"
        self.failed: str | None = "not asked to record" if mode == "uncaptured" else None
        self.replays = 0

    @property
    def stream(self) -> Any:
        return self.graph.stream

    def step(
        self,
        step: int,
        ctx: Any,
        inputs: list[np.ndarray],
        body: Callable[..., None],
        before: Callable[[], None] | None = None,
        bookkeeping: Callable[[], Callable[[], None]] | None = None,
    ) -> str:
        """One step of ``body(step, ctx, *device_inputs)``. ``before()`` enqueues what comes
        ahead of the step on the graph's stream at every step (an upload into fixed buffers);
        ``bookkeeping()`` snapshots the host state a recording changes and returns what
        restores it, for a recording that fails. Returns ``"uncaptured"``, ``"recorded"`` (a
        recording was made and replayed: its host side ran as for an uncaptured step) or
        ``"replayed"`` (nothing ran on the host: the caller does the step's bookkeeping)."""
        key = tuple((a.shape, a.dtype.str) for a in inputs)
        if self.graph is not None:  # after what the caller's stream did (an evaluation's reads)
            self.stream.wait_event(self.cupy.cuda.get_current_stream().record())
        fresh = key != self.shape_key  # the first step, or a new shape: uncaptured, a warm-up
        if fresh:
            self._start_shape(key, inputs)
        elif self.recorded:
            with self.stream:
                self._stage(step, ctx, inputs, before)
                self.graph.replay()
            self.replays += 1
            return "replayed"
        with self.stream:  # staged once, whether the step is then recorded or run
            dev = self._stage(step, ctx, inputs, before)
        if not fresh and self.failed is None:
            undo = bookkeeping() if bookkeeping is not None else None
            try:
                self.graph.record(lambda: body(step, ctx, *dev))
            except Exception as e:  # the run goes on uncaptured: same code, same bits
                if undo is not None:
                    undo()
                if self.strict:
                    raise RuntimeError(f"gpu.graphs: the step could not be recorded: {e}") from e
                self.failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                self.notice(
                    f"raysinga: gpu.graphs: a step could not be recorded as a CUDA graph "
                    f"({self.failed}); training goes on without graphs"
                )
            else:
                self.recorded = True
                self.graph.replay()  # the recording ran nothing on the GPU: this is the step
                self.replays += 1
                return "recorded"
        self.graph.run(lambda: body(step, ctx, *dev))
        return "uncaptured"

    def _stage(self, step: int, ctx: Any, inputs: list, before: Callable | None) -> list:
        if before is not None:
            before()
        self.values.refresh(step, ctx)
        return self.staging.load(inputs)

    def _start_shape(self, key: tuple, inputs: list[np.ndarray]) -> None:
        self.synchronize()
        # What the caller wrote on its own stream (the parameters, the optimizer's slots): the
        # graph's non-blocking stream does not wait for it by itself.
        self.cupy.cuda.get_current_stream().synchronize()
        self.graph = self.gg.StepGraph()
        self.staging = self.gg.Staging(inputs)
        self.shape_key, self.recorded = key, False

    def synchronize(self) -> None:
        """Wait for every step launched (before their results are read on another stream)."""
        if self.graph is not None:
            self.graph.synchronize()


class GraphStep:
    """The single-process trainer's step (forward, loss, backward, clipping, the optimizer's
    update) through a :class:`StepRecorder`.

    :meth:`step` takes the host batch of a step; :meth:`results` hands back ``(step, loss,
    grad_norm or None)`` for the steps done so far, in order, reading the device only when asked
    to (``force``) or when the ring is full.
    """

    def __init__(
        self,
        net: Any,
        optimizer: Any,
        params: dict,
        state: dict,
        clip_norm: float | None,
        notice: Callable[[str], None],
        mode: str = "on",
    ) -> None:
        self.rec = StepRecorder(notice, mode)
        self.net, self.optimizer, self.params, self.state = net, optimizer, params, state
        self.clip_norm = clip_norm
        self.readback = self.rec.gg.Readback(width=2, depth=DEPTH)
        self.out = self.rec.cupy.zeros(2, np.float64)  # (loss, norm), where the graph writes
        self._ready: list[tuple[int, float, float | None]] = []
        self._names = sorted(net.param_shapes())
        self._shape: tuple | None = None

    @property
    def failed(self) -> str | None:
        return self.rec.failed

    @property
    def replays(self) -> int:
        return self.rec.replays

    @property
    def recorded(self) -> bool:
        return self.rec.recorded

    def _body(self, step: int, ctx: Any, x: Any, y: Any) -> None:
        loss, grads, _ = self.net.loss_and_grads(self.params, self.state, x, y, ctx, on_device=True)
        self.out[0] = loss
        if self.clip_norm:
            self.out[1] = clip_grad_norm_on_device(grads, self.clip_norm)
        self.optimizer.update_all(step, self.params, grads, values=self.rec.values)

    def _bookkeeping(self) -> Callable[[], None]:
        counts = dict(self.optimizer.counts)

        def undo() -> None:
            self.optimizer.counts = counts

        return undo

    def step(self, step: int, ctx: Any, x: np.ndarray, y: np.ndarray) -> None:
        inputs = checked_inputs(self.net, x, y)
        shape = tuple(a.shape for a in inputs)
        if shape != self._shape:
            self.results(force=True)  # nothing of the old shape's graph is left pending
            self._shape = shape
        ctx = dataclasses.replace(ctx, values=self.rec.values)
        how = self.rec.step(step, ctx, inputs, self._body, bookkeeping=self._bookkeeping)
        if how == "replayed":
            self.optimizer.advance(self._names)
        if self.readback.full:
            self._collect()
        with self.rec.stream:
            self.readback.push(step, self.out)

    def _collect(self) -> None:
        for step, (loss, norm) in self.readback.drain():
            self._ready.append((step, float(loss), float(norm) if self.clip_norm else None))

    def results(self, force: bool = False) -> list[tuple[int, float, float | None]]:
        """``(step, loss, grad_norm)`` of the steps done and not yet handed back, in order;
        with ``force``, every step so far (waits for the GPU), else only those already read."""
        if force:
            self._collect()
        out, self._ready = self._ready, []
        return out

    def synchronize(self) -> None:
        """Wait for every step launched (before the parameters are read on another stream)."""
        self.rec.synchronize()


class WorkerGraphStep:
    """A GPU worker's step of a distributed run through a :class:`StepRecorder`: the servers'
    values are uploaded into the worker's fixed device buffers ahead of each step, the forward
    and backward pass write the gradients into fixed device buffers, and those come down into the
    worker's shared gradient buffer with the loss (the stub sums them at once: no step is left
    pending here)."""

    def __init__(
        self,
        net: Any,
        state: dict,
        device: Any,
        denom: int,
        notice: Callable[[str], None],
        mode: str = "on",
    ) -> None:
        self.rec = StepRecorder(notice, mode)
        self.net, self.state, self.device, self.denom = net, state, device, denom
        cp = self.rec.cupy
        self.grads = {k: cp.empty(v.shape, v.dtype) for k, v in device.params.items()}
        self.out = cp.zeros(1, np.float64)
        # bf16: the weights' copies, cast from the uploaded values within the recorded step
        self.copies = (
            precision.WeightCopies(device.params) if precision.compute() == "bf16" else None
        )

    def _body(self, step: int, ctx: Any, x: Any, y: Any) -> None:
        if self.copies is not None:
            self.copies.refresh()
        with precision.copies_in_use(self.copies):
            loss, grads, _ = self.net.loss_and_grads(
                self.device.params, self.state, x, y, ctx, self.denom, on_device=True
            )
        self.out[0] = loss
        for k, g in grads.items():
            self.grads[k][...] = g

    def step(self, step: int, ctx: Any, x: np.ndarray, y: np.ndarray, params: dict) -> float:
        """The loss of the worker's part of ``step``; its gradients are in the shared buffer
        when this returns. ``params``: the servers' values (host arrays)."""
        inputs = checked_inputs(self.net, x, y)
        ctx = dataclasses.replace(ctx, values=self.rec.values)
        self.rec.step(step, ctx, inputs, self._body, before=lambda: self.device.upload(params))
        with self.rec.stream:
            self.device.download_grads(self.grads)  # waits for the stream: the step is done
            return float(self.out.get(stream=self.rec.stream)[0])


def checked_inputs(net: Any, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """The host batch as the net takes it, checked on the host (a recorded step reads no device
    value back, so its kernels cannot check ids and labels)."""
    x = np.ascontiguousarray(x if net.takes_tokens else np.asarray(x, net.dtype))
    y = np.ascontiguousarray(y)
    if net.takes_tokens:
        _check_ids(x, net.layers[0].opts["vocab"], "token id")
    if net.classifies:
        _check_ids(y, net.output_shape[-1], "label")
    return [x, y]


def _check_ids(a: np.ndarray, bound: int, what: str) -> None:
    if a.dtype.kind not in "iu":
        raise TypeError(f"{what}s must be integers, got {a.dtype}")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= bound):
        bad = a[(a < 0) | (a >= bound)].flat[0]
        raise ValueError(f"{what} {int(bad)} is outside [0, {bound})")
