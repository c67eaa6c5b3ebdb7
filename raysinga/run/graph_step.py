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
code without recording, the reference a recorded run matches bit for bit). A step that cannot
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

from raysinga.nn.losses import CLASSIFYING
from raysinga.optim.grads import clip_grad_norm_on_device

ENV = "RAYSINGA_GPU_GRAPHS"
# Steps whose loss and gradient norm wait in the pinned ring before the host reads them: the
# divergence guard sees a step at most this many steps late (and always before a checkpoint).
DEPTH = 32


def graphs_mode(job_setting: bool) -> str:
    """``"on"``, ``"off"``, or ``"uncaptured"`` (the graphs' code, run step by step without
    recording: the reference a recorded run must match bit for bit): the job's ``gpu.graphs``
    unless ``RAYSINGA_GPU_GRAPHS`` (``1``, ``0`` or ``uncaptured``) says otherwise."""
    env = os.environ.get(ENV, "").strip().lower()
    if env in ("", "auto"):
        return "on" if job_setting else "off"
    if env in ("1", "true", "on", "yes"):
        return "on"
    if env in ("0", "false", "off", "no"):
        return "off"
    if env == "uncaptured":
        return env
    raise ValueError(f"{ENV} must be 1, 0 or uncaptured (or unset), got {env!r}")


class GraphStep:
    """Runs training steps of one net and optimizer on the GPU through CUDA graphs.

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
        record: bool = True,
    ) -> None:
        from raysinga.kernels import cupy_module, gpu_blas, gpu_graph  # noqa: PLC0415 - CuPy

        error = gpu_blas.import_error()
        if error is not None:
            raise RuntimeError(f"gpu.graphs: {error}; pip install 'raysinga[gpu]'")
        gpu_blas.use(True)
        self.cupy = cupy_module()
        self.gg = gpu_graph
        self.net, self.optimizer, self.params, self.state = net, optimizer, params, state
        self.clip_norm, self.notice = clip_norm, notice
        self.values = gpu_graph.StepValues()
        self.readback = gpu_graph.Readback(width=2, depth=DEPTH)
        self.out = None  # (loss, norm) of the step, float64, where the graph writes them
        self.graph: Any = None
        self.staging: Any = None
        self.shape_key: tuple | None = None
        self.recorded = False
        self.failed: str | None = None if record else "not asked to record"
        self.replays = 0
        self._ready: list[tuple[int, float, float | None]] = []
        self._names = sorted(net.param_shapes())

    # -- the step
    def _body(self, step: int, ctx: Any, x: Any, y: Any) -> None:
        loss, grads, _ = self.net.loss_and_grads(self.params, self.state, x, y, ctx, on_device=True)
        self.out[0] = loss
        if self.clip_norm:
            self.out[1] = clip_grad_norm_on_device(grads, self.clip_norm)
        self.optimizer.update_all(step, self.params, grads, values=self.values)

    def _inputs(self, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
        """The batch as the net takes it, checked on the host (the recorded step reads no
        device value back, so its kernels cannot)."""
        x = np.ascontiguousarray(x if self.net.takes_tokens else np.asarray(x, self.net.dtype))
        y = np.ascontiguousarray(y)
        if self.net.takes_tokens:
            _check_ids(x, self.net.layers[0].opts["vocab"], "token id")
        if self.net.spec.loss in CLASSIFYING:
            _check_ids(y, self.net.output_shape[-1], "label")
        return [x, y]

    def step(self, step: int, ctx: Any, x: np.ndarray, y: np.ndarray) -> None:
        inputs = self._inputs(x, y)
        ctx = dataclasses.replace(ctx, values=self.values)
        key = tuple((a.shape, a.dtype.str) for a in inputs)
        if self.graph is not None:  # after what the caller's stream did (an evaluation's reads)
            self.graph.stream.wait_event(self.cupy.cuda.get_current_stream().record())
        if key != self.shape_key:  # the first step, or a new shape: uncaptured, a warm-up
            self._start_shape(key, inputs)
            self._run(step, ctx, inputs)
            return
        if self.recorded:
            with self.graph.stream:
                self.values.refresh(step, ctx)
                self.staging.load(inputs)
                self.graph.replay()
            self.optimizer.advance(self._names)
            self.replays += 1
            self._push(step)
            return
        if self.failed is None:
            counts = dict(self.optimizer.counts)
            try:
                with self.graph.stream:
                    self.values.refresh(step, ctx)
                    x_dev, y_dev = self.staging.load(inputs)
                self.graph.record(lambda: self._body(step, ctx, x_dev, y_dev))
            except Exception as e:  # the run goes on uncaptured: same code, same bits
                self.optimizer.counts = counts
                self.failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                self.notice(
                    f"raysinga: gpu.graphs: a step could not be recorded as a CUDA graph "
                    f"({self.failed}); training goes on without graphs"
                )
            else:
                self.recorded = True
                self.graph.replay()  # the recording ran nothing: this is the step
                self.replays += 1
                self._push(step)
                return
        self._run(step, ctx, inputs)

    def _start_shape(self, key: tuple, inputs: list[np.ndarray]) -> None:
        self.results(force=True)  # nothing of the old shape's graph is pending
        self.synchronize()
        # The parameters and optimizer slots were written on the caller's stream, which the
        # graph's (non-blocking) stream does not wait for by itself.
        self.cupy.cuda.get_current_stream().synchronize()
        self.graph = self.gg.StepGraph()
        self.staging = self.gg.Staging(inputs)
        with self.graph.stream:
            self.out = self.cupy.zeros(2, np.float64)
        self.shape_key, self.recorded = key, False

    def _run(self, step: int, ctx: Any, inputs: list[np.ndarray]) -> None:
        """The step uncaptured, with the code a recording runs."""
        with self.graph.stream:
            self.values.refresh(step, ctx)
            x_dev, y_dev = self.staging.load(inputs)
        self.graph.run(lambda: self._body(step, ctx, x_dev, y_dev))
        self._push(step)

    def _push(self, step: int) -> None:
        if self.readback.full:
            self._collect()
        with self.graph.stream:
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
        if self.graph is not None:
            self.graph.synchronize()


def _check_ids(a: np.ndarray, bound: int, what: str) -> None:
    if a.dtype.kind not in "iu":
        raise TypeError(f"{what}s must be integers, got {a.dtype}")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= bound):
        bad = a[(a < 0) | (a >= bound)].flat[0]
        raise ValueError(f"{what} {int(bad)} is outside [0, {bound})")
