"""A worker: computes loss and gradients of its part of its group's batch.

The worker reads parameters straight from the servers' buffers (zero-copy on the same node),
picks its own sub-batch from (seed, step, part) so no data passes through the stub, and writes its
gradient into a persistent buffer that the stub reads in place.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from raysinga.data import BatchPlan
from raysinga.data.cursor import DataCursor
from raysinga.data.splits import open_splits
from raysinga.kernels import precision, to_numpy
from raysinga.kernels.cpu_memory import retain_freed_memory
from raysinga.kernels.cpu_sched import batch_scheduling
from raysinga.kernels.cpu_threads import blas_threads
from raysinga.nn.layers import StepContext
from raysinga.nn.model import ModelSpec, Net
from raysinga.obs.raymetrics import Recorder
from raysinga.run.evaluate import evaluate_splits
from raysinga.run.graph_step import WorkerGraphStep

from .common.buffers import SharedBuffer, ShmHandle
from .common.device import WorkerDevice, warm
from .common.errors import reports_role
from .common.protocol import (
    STATE_TAGS,
    BlockSend,
    MirrorAt,
    Published,
    ServerAt,
    Wiring,
    WorkerDone,
    WorkerSpec,
    node_id,
    read_state_copy,
    updates_later,
    visible_gpus,
    worker_buffer_layout,
    write_state_copy,
)
from .exchange.doorbell import Abortable, Steps
from .exchange.fence import Fence
from .exchange.mirrors import Mirrors
from .hostsum.worker_side import BlockSums, EarlySends, block_sum, summed_members
from .memory.param_reader import ParamReader


class Worker(Abortable, Fence):
    role = "worker"

    def __init__(self, spec: WorkerSpec) -> None:
        # For this process's life: the single-process run of the job uses the same count.
        self._blas = blas_threads(spec.blas_threads)
        precision.use(spec.precision)  # for this process's life, as the BLAS threads
        retain_freed_memory()  # each step's temporaries reuse the last step's pages
        self.index, self.group, self.seed = spec.index, spec.group, spec.seed
        self.label = f"{spec.tag} g{spec.group}w{spec.index}"  # the run (name and id), the role
        self.n_groups, self.group_batch = spec.n_groups, spec.group_batch
        # the driver ran the user's own layers once as it read the job (nn.checks.probe)
        model = ModelSpec.from_dict(spec.model, probe=False)
        self.net = Net(model, spec.dtype, spec.dw_row_blocks)
        self.state = self.net.init_state()
        self.cursor = DataCursor()  # a resumed run's, else from the start
        self.splits = open_splits(spec.data, spec.validation)
        self.train = self.splits.train
        self.plan = BatchPlan(len(self.train), spec.group_batch, spec.seed, spec.shuffle)
        shapes = self.net.param_shapes()
        self.reader = ParamReader(
            shapes,
            spec.slices,
            spec.n_servers,
            spec.dtype,
            consistent=spec.n_groups > 1,
            wire=spec.wire,
            check=self.check_abort,
        )
        self.slices, self.wire = spec.slices, spec.wire
        self.rec = Recorder(spec.metrics, "worker", spec.index, spec.group)
        self.block_sums = BlockSums()  # as a block's leader (reduce: hosts)
        self.computed: tuple[int, int] | None = None  # (epoch, step) of its last compute
        self.node = node_id()
        # reduce: hosts: where this is its node's first worker, its mirrors of the servers
        self.mirrors = Mirrors.of(spec, self.reader.layouts, self.node)
        self.state_shapes = self.net.state_shapes()
        self.grads = SharedBuffer(
            f"{spec.tag}-g{spec.group}w{spec.index}",
            worker_buffer_layout(shapes, spec.dtype, self.state_shapes),
            self.node,
        )
        # The step whose start the state in memory is the state at: None where it is right for
        # whatever step comes next (a fresh or restored worker), -1 where a step was cut short.
        self.state_at: int | None = None
        if self.state_shapes:  # no copy yet (a zero-filled tag would name step 0)
            self.grads.arrays[STATE_TAGS][...] = -1
        self._copies: precision.WeightCopies | None = None  # a GPU worker's, once made
        self.gpu: WorkerDevice | None = None  # device: "gpu" (a worker given GPUs)
        self.graphs: WorkerGraphStep | None = None  # gpu.graphs: the step as a CUDA graph
        if spec.device == "gpu":
            self.gpu = WorkerDevice(shapes, spec.dtype, self.grads)
            self.state = {k: self.gpu.asarray(v) for k, v in self.state.items()}
            if spec.graphs != "off":
                self.graphs = WorkerGraphStep(
                    self.net,
                    self.state,
                    self.gpu,
                    spec.group_batch,
                    lambda line: print(f"{self.label}: {line}", flush=True),
                    spec.graphs,
                )
        elif spec.device != "cpu":
            raise ValueError(f"device must be 'cpu' or 'gpu', got {spec.device!r}")

    def __repr__(self) -> str:  # how Ray's dashboard and log prefixes name this actor
        return f"Worker({self.label})"

    @reports_role
    def describe(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "pid": os.getpid(),  # where `raysinga status` shows it, to find the process
            "handle": self.grads.handle(),
            "state": self.state_shapes,
            "gpus": visible_gpus() if self.gpu is not None else None,
            "mirror": self.mirrors.describe() if self.mirrors is not None else None,
        }

    @reports_role
    def warm(self, parts: int = 1) -> float:
        """A GPU worker's spare: one training step of a worker's part of its group's batch
        (one of ``parts``) run and dropped (:func:`.device.warm`)."""
        return warm(self, parts)

    def batch_index(self, step: int) -> int:
        """Groups take turns through one data order, so no two groups train on one batch."""
        return self.cursor.batch(step, self.group, self.n_groups)

    @reports_role
    def get_state(self) -> dict[str, np.ndarray]:
        """Copies of this worker's non-trainable state (batch-norm running statistics)."""
        return {k: np.array(to_numpy(v), copy=True) for k, v in self.state.items()}

    @reports_role
    def adopt(self, index: int) -> None:
        """A spare takes the place of lost worker ``index`` of its group (its part of the
        batch comes with each step; the index names it in errors)."""
        self.index = index
        self.rec.adopt(index)  # its metrics are worker ``index``'s from now on

    @reports_role
    def restore(self, state: dict[str, np.ndarray], cursor: DataCursor) -> None:
        """Resume: saved non-trainable state (what of it there is) and the data cursor."""
        for k, v in state.items():
            if k not in self.state or self.state[k].shape != v.shape:
                raise ValueError(f"worker state {k!r} does not fit this model")
            self.state[k][...] = v if self.gpu is None else self.gpu.asarray(v)
        self.cursor = cursor
        self.state_at = None

    @reports_role
    def compute(
        self,
        step: int,
        part: int,
        parts: int,
        snapshot: bool,
        *sources: ShmHandle | Published,
        epoch: int = 0,
        send: BlockSend | None = None,
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        """Loss and gradient of part ``part`` of ``parts`` of the group's batch at ``step``,
        for a stub of ``epoch`` (an older one's is refused: :mod:`.fence`).

        The loss is divided by the group's batch size, so the group's gradient is the plain sum
        of its workers' gradients. Returns timings and, when the stub is on another node, a
        snapshot of the gradient buffer. ``send`` (a block of one worker, ``topology.reduce:
        hosts``): the gradient goes to the servers as the backward pass makes it
        (:class:`.worker_side.EarlySends`); the timings then carry the bytes sent to each
        server (``"sent"``).
        """
        self.admit(epoch, f"compute step {step} (worker {self.index} of group {self.group})")
        self.computed = None
        early = None if send is None else EarlySends(self, send, step, epoch)
        stats = self._compute(step, part, parts, self.fetched(sources), early)
        self.rec.flush()
        if early is not None:
            stats["sent"] = early.finish()
        self.computed = (epoch, step)  # what a sum of its block may take from its buffer
        return stats, (self.grads.snapshot() if snapshot else None)

    @reports_role
    def compute_steps(
        self,
        start: int,
        stop: int,
        part: int,
        parts: int,
        *sources: MirrorAt | ServerAt,
        epoch: int = 0,
        send: BlockSend | None = None,
    ) -> list[dict[str, Any]]:
        """Steps ``start .. stop-1`` of a group summed by hosts (``topology.reduce: hosts``),
        each as :meth:`compute` computes it, in one call (:func:`.stub_side.block_steps`):
        ``sources`` are the servers' values step ``start`` reads, and each step after reads
        those after one more update of every server. A step waits for its values asleep, so
        the loop keeps pace with the servers without a call per step. Returns each step's
        timings, in order."""
        out = []
        for j, step in enumerate(range(start, stop)):
            later = tuple(updates_later(s, j) for s in sources)
            stats, _ = self.compute(step, part, parts, False, *later, epoch=epoch, send=send)
            out.append(stats)
        return out

    @reports_role
    def serve(
        self,
        start: int,
        stop: int,
        part: int,
        parts: int,
        wiring: Wiring,
        *sources: ShmHandle,
        epoch: int = 0,
    ) -> list[dict[str, float]]:
        """Compute steps ``start .. stop-1`` as they are rung for (same node only) by a stub of
        ``epoch``; returns what each step measured (:attr:`WorkerDone.STATS`)."""
        self.admit(epoch, f"serve steps {start}-{stop - 1} (worker {self.index})")
        batch_scheduling()  # woken by a ring, this thread never preempts the ringer

        def step_fn(step: int) -> tuple[dict[str, float], WorkerDone]:
            st = self._compute(step, part, parts, sources)
            stats = {k: st[k] for k in WorkerDone.STATS}
            return stats, WorkerDone(part, step, 0, **stats)

        failed = WorkerDone(part, -1, 1, 0.0, 0.0, 0.0, 0.0, 0.0)  # wakes the stub at once
        steps = Steps(wiring, WorkerDone, self.check_abort)
        return steps.run(start, stop, step_fn, failed, self.rec.flush)

    @reports_role
    def host_sum(
        self,
        step: int,
        members: tuple[ShmHandle | Published, ...],
        done: tuple[Any, ...] = (),
        to: Sequence[tuple[str, int, bytes]] = (),
        block: int = 0,
        epoch: int = 0,
    ) -> tuple[float, list[int]]:
        """As the leader of block ``block`` (``topology.reduce: hosts``): the sum of the
        block's workers' gradients of ``step`` (``members``, in worker order: the buffer of
        one on this node, the published snapshot of one elsewhere; ``done``: the others'
        results, :func:`.worker_side.summed_members`), added in that order, cut into each
        server's slices, laid out as they cross (:mod:`.wire`) and sent to each server's
        inbox (``to``, in server order)."""
        self.admit(epoch, f"sum step {step} of its block (worker {self.index})")
        members = summed_members(self, step, epoch, members, done)
        return block_sum(self, members, to, step, block, epoch)

    def _compute(
        self, step: int, part: int, parts: int, sources: tuple, early: EarlySends | None = None
    ) -> dict[str, Any]:
        start = time.time()
        t0 = time.perf_counter()
        if self.state_shapes:
            self._state_for(step)
        params = self.reader.read(sources)
        if self.gpu is not None and self.graphs is None:
            params = self.gpu.upload(params)
        t1 = time.perf_counter()
        b = self.batch_index(step)
        lo, _ = self.plan.slice_bounds(part, parts)
        x, y = self.train.get(self.plan.indices(b, part, parts))
        ctx = StepContext(train=True, seed=self.seed, step=b, sample_offset=lo)
        if self.graphs is not None:  # the upload is staged with the recorded step
            loss = self.graphs.step(step, ctx, x, y, params)
        else:
            loss = self._eager(params, x, y, ctx, early)
        if self.state_shapes:
            write_state_copy(self.grads.arrays, self._host_state(), step + 1)
            self.state_at = step + 1
        t2 = time.perf_counter()
        self.rec.later({"fetch": t1 - t0, "compute": t2 - t1})  # recorded by the caller
        return {
            "loss": loss,
            "fetch": t1 - t0,
            "compute": t2 - t1,
            "start": start,
            "end": time.time(),
        }

    def _state_for(self, step: int) -> None:
        """The state at the start of ``step``: as it is, or (a step done again after a loss
        in the group, or one cut short) the copy this worker made of it."""
        if self.state_at is None:  # fresh or restored: what is in memory is this step's
            write_state_copy(self.grads.arrays, self._host_state(), step)
            self.state_at = step
        if self.state_at == step:
            self.state_at = -1  # until this step is done
            return
        copy = read_state_copy(self.grads.arrays, list(self.state_shapes), step)
        if copy is None:
            raise RuntimeError(
                f"worker {self.label}: no copy of its state at step {step} (it stands at "
                f"{self.state_at}): the step cannot be redone exactly"
            )
        for k, v in copy.items():
            self.state[k][...] = v if self.gpu is None else self.gpu.asarray(v)
        self.state_at = -1

    def _weight_copies(self, params: dict) -> precision.WeightCopies | None:
        """Under the bf16 compute precision, the bfloat16 copies of this step's weights (the
        servers' values, just read): cast once here, and read by every matrix product of the
        step in place of a cast at each use. A GPU worker keeps one set over its fixed device
        buffers; on the CPU the values are wherever the servers' buffers are mapped."""
        if precision.compute() != "bf16":
            return None
        if self.gpu is None:
            return precision.WeightCopies(params)
        if self._copies is None:
            self._copies = precision.WeightCopies(params)
        else:
            self._copies.refresh()
        return self._copies

    def _host_state(self) -> dict[str, np.ndarray]:
        return {k: to_numpy(v) for k, v in self.state.items()}

    def _eager(
        self, params: dict, x: Any, y: Any, ctx: StepContext, early: EarlySends | None = None
    ) -> float:
        """The step launched op by op; the gradients end in the shared buffer. On a CPU each
        layer's are put there as soon as the layer is done, and ``early`` told."""
        x = self.net.prepare_input(x)
        if self.gpu is not None:
            x, y = self.gpu.asarray(x), self.gpu.asarray(y)
        into = None if self.gpu is not None else self.grads.arrays  # written in place there
        hooks = {}  # each layer's gradients put into the buffer, and the early sends told
        if into is not None:
            hooks["on_grads"] = _into_buffer(into, early and early.done)
        if into is not None and early is not None:
            hooks["on_ready"] = _into_buffer(into, early.ready)
            hooks["on_rows"] = early
        with precision.copies_in_use(self._weight_copies(params)):
            loss, grads, _ = self.net.loss_and_grads(
                params, self.state, x, y, ctx, self.group_batch, into, **hooks
            )
        if self.gpu is not None:
            self.gpu.download_grads(grads)
        return loss

    @reports_role
    def evaluate(self, batch_size: int, *sources: Any) -> dict[str, float]:
        if not self.splits.held_out():
            return {}
        params = self.reader.read(self.fetched(sources))
        if self.gpu is not None:
            params = self.gpu.upload(params)
            xp = self.gpu.cp
        else:
            xp = np
        return evaluate_splits(self.net, params, self.state, self.splits, batch_size, xp)

    @reports_role
    def pid(self) -> int:
        import os  # noqa: PLC0415

        return os.getpid()

    def shutdown(self) -> None:
        self.block_sums.close()
        if self.mirrors is not None:
            self.mirrors.close()
        if self.gpu is not None:
            self.gpu.close()
        self.grads.close()


def _into_buffer(
    buffer: dict[str, np.ndarray], then: Callable[[Iterable[str]], None] | None
) -> Callable[[dict[str, Any]], None]:
    """What a CPU worker's backward pass hands each layer's gradients to: each put into the
    worker's shared ``buffer`` (those the layer did not write there), then ``then`` told
    their names (:meth:`.worker_side.EarlySends.ready`, :meth:`~.worker_side.EarlySends.done`)."""

    def tell(grads: dict[str, Any]) -> None:
        for k, g in grads.items():
            if g is not buffer[k]:
                buffer[k][...] = g
        if then is not None:
            then(grads)

    return tell
