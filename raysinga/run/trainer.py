"""The single-process trainer: the exact reference that the distributed trainer reproduces.

One step is: take batch ``step`` of the plan (a pure function of seed and step), compute loss and
gradients, clip, and let the optimizer update every parameter in name order. Nothing here depends
on wall-clock time or on arrival order, so two runs with one config give the same bits.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from raysinga import kernels as K
from raysinga.config.job import JobConfig
from raysinga.data import BatchPlan, Dataset
from raysinga.data import identity as data_identity
from raysinga.data.check import check_splits
from raysinga.data.splits import Splits, open_splits
from raysinga.kernels import precision
from raysinga.kernels.cpu_threads import blas_threads, compute_threads
from raysinga.nn.layers import StepContext, dw_row_blocks
from raysinga.nn.model import Net
from raysinga.obs.console import hub_for
from raysinga.obs.events import Evaluated, RunStarted, Subscriber, TrainStep
from raysinga.obs.metrics import TrainResult, recording
from raysinga.optim.grads import clip_grad_norm, clip_grad_norm_on_device
from raysinga.optim.optimizers import make_optimizer

from . import local_checkpoint
from .divergence import Guard, chance_loss, describe_topology
from .evaluate import evaluate_splits
from .graph_step import DEPTH, GraphStep, graphs_mode
from .session import RunSession, Start, check_start_options
from .sources import verify_all


class Trainer:
    """Runs a :class:`JobConfig` in this process (no Ray)."""

    def __init__(
        self,
        cfg: JobConfig,
        log: Callable[[str], None] | None = print,
        resume: bool | str = False,
        init_from: Any = None,
        fresh: bool = False,
        on_event: Subscriber | Iterable[Subscriber] | None = None,
        fork_from: Any = None,
        until: int | None = None,
    ) -> None:
        """``resume`` (True, or "auto": only if there is a checkpoint), ``init_from`` (a
        checkpoint path, URI, :class:`~raysinga.checkpoint.Checkpoint` or object-store ref whose
        parameters start a new run) and ``fresh`` (delete the run's checkpoints first) work as
        in :class:`~raysinga.distributed.DistributedTrainer`; checkpoints are written in this
        process, in the same layout (one server). ``log`` gets the run's events as console
        lines; ``on_event`` gets the events themselves (:mod:`raysinga.obs.events`).

        ``fork_from`` (a checkpoint, as ``init_from``, of this job or another run of the same
        model and data) starts from its whole state, parameters, optimizer state, data position
        and random stream, but under this job's optimizer hyperparameters and schedule: what
        population-based training does when a trial takes over a better one's state.
        ``until`` stops after that step with a checkpoint of it, as if the run were stopped
        there (``train_steps``, and so the learning-rate schedule, stay the job's)."""
        check_start_options(resume, init_from, fresh, fork_from)
        if until is not None and not 0 < until <= cfg.train_steps:
            raise ValueError(f"until must lie in [1, train_steps={cfg.train_steps}], got {until}")
        self.cfg = cfg
        self.resume, self.init_from, self.fresh = resume, init_from, fresh
        self.fork_from, self.until = fork_from, until
        self.hub = hub_for(log, on_event)
        self.device = _resolve_device(cfg.device, self.hub.notice)
        self.xp = K.xp_for(self.device)
        # a job summed by hosts (its --local twin): dense weights' gradients by blocks, as its
        # workers compute them
        reduce = cfg.topology.reduce if cfg.topology is not None else "stub"
        self.net = Net(cfg.model, cfg.dtype, dw_row_blocks(reduce))
        self.splits = open_data(cfg, self.net, self.hub.notice)
        self.train_data = self.splits.train
        self.plan = BatchPlan(len(self.train_data), cfg.data.batch_size, cfg.seed, cfg.data.shuffle)
        self.optimizer = make_optimizer(cfg.optimizer)
        self.run_dir = Path(cfg.run_path)
        self.graphs: GraphStep | None = None  # the run's CUDA graphs (gpu.graphs), once fitting

    def fit(self) -> TrainResult:
        cfg = self.cfg
        if cfg.checkpoint.object_store:  # the registry is a Ray actor
            from raysinga.cluster.connect import connect  # noqa: PLC0415 - Ray only where asked for

            connect()
        data = data_identity.identity(self.train_data, cfg.data.batch_size, cfg.data.shuffle)
        session = RunSession(
            cfg,
            self.net.param_shapes(),
            self.net.dtype,
            data,
            self.hub,
            self.resume,
            self.init_from,
            self.fresh,
            self.fork_from,
        )
        note = precision.emulation_note(cfg.precision.compute, self.device)
        if note:
            self.hub.notice(note)
        with (
            session,
            session.stop_signals(),
            blas_threads(self.blas_threads),
            precision.using(cfg.precision.compute),
        ):
            start = session.verify(verify_all)
            params, state = local_checkpoint.load_start(start, self.net, self.optimizer)
            return session.finish(self._fit(session, start, params, state))

    @property
    def blas_threads(self) -> int | None:
        """A job with a topology runs here on as many BLAS threads as each of its workers, so
        that this run and a one-worker, one-server run of it give the same bits; without one,
        on as many as the BLAS takes."""
        topo = self.cfg.topology
        return None if topo is None else compute_threads(topo.worker.cpus)

    def _fit(self, session: RunSession, start: Start, params: dict, state: dict) -> TrainResult:
        cfg, xp = self.cfg, self.xp
        (first,), cursor = start.position(1)
        params = {k: xp.asarray(v) for k, v in params.items()}
        state = {k: xp.asarray(v) for k, v in state.items()}
        result = TrainResult({}, {}, start.history(first))
        n_params = sum(int(np.prod(s)) for s in self.net.param_shapes().values())
        self.hub.emit(
            RunStarted(
                cfg.name,
                f"{self.device} for {cfg.train_steps} steps, batch {cfg.data.batch_size}, "
                f"{len(self.train_data)} training samples, {n_params:,} parameters",
                cfg.train_steps,
                first,
            )
        )

        def save(step: int, final: bool = False) -> None:
            if not final or cfg.checkpoint.final:
                local_checkpoint.save(
                    session, step, self.net, self.optimizer, params, state, cursor, result.history
                )

        session.guard = guard = Guard(
            cfg.divergence,
            result.history,
            [first],
            chance_loss(self.net.spec.loss, self.net.output_shape),
            lambda s: (self.optimizer.lr(s), describe_topology(None)),
            cfg.data.batch_size,
        )
        window_loss, window_steps, t0 = 0.0, 0, time.perf_counter()
        graphs = self._graph_step(params, state)
        grad_norm = None

        def observe(done: list[tuple[int, float, float | None]]) -> None:
            """The divergence guard and the display window take each step's loss in order."""
            nonlocal window_loss, window_steps, grad_norm
            for s, loss, norm in done:
                level = guard.observe(s, loss, norm)
                if level is not None:
                    self.hub.emit(level)
                window_loss, window_steps, grad_norm = window_loss + loss, window_steps + 1, norm

        # The eager GPU step's losses and norms stay on the device until a report, a check or
        # DEPTH steps need them; then they are read in one go (reading each step's would wait
        # for the GPU at every step).
        pending: list[tuple[int, Any, Any]] = []

        def read_pending() -> None:
            if pending:
                observe(read_back(xp, pending))
                pending.clear()

        def settle() -> None:
            """Every launched step observed and finished (before its values are read)."""
            read_pending()
            if graphs is not None:
                observe(graphs.results(force=True))
                graphs.synchronize()

        with (
            recording(self.hub, self.run_dir, result, cfg.tensorboard),
            weight_copies(params, self.optimizer),
        ):
            end = cfg.train_steps if self.until is None else self.until
            for step in range(first, end):
                if session.stop_signal is not None:
                    settle()
                    save(step, final=True)
                    raise session.preempted(step)
                b = cursor.batch(step)
                epoch, _ = self.plan.cursor(b)
                x, y = self.train_data.get(self.plan.indices(b))
                ctx = StepContext(train=True, seed=start.seed, step=b)
                lr = self.optimizer.lr(step)
                done = step + 1
                shown = done % cfg.disp_freq == 0 or done == cfg.train_steps
                evaluated = cfg.evaluation_due(done) and self.splits.held_out()
                # a step whose values a report, a check or the run's end reads: what the
                # device holds back is read first
                due = shown or evaluated or cfg.checkpoint_due(done) or done == end
                if graphs is not None:
                    graphs.step(step, ctx, x, y)
                    if due:
                        settle()
                    else:
                        observe(graphs.results())
                else:
                    loss, grads, _ = self.net.loss_and_grads(
                        params, state, self.net.prepare_input(x, xp), xp.asarray(y), ctx
                    )
                    clip = cfg.clip_norm
                    if xp is np:
                        norm = clip_grad_norm(grads, clip) if clip else None
                        observe([(step, float(loss), norm)])
                    else:
                        norm = clip_grad_norm_on_device(grads, clip) if clip else None
                        pending.append((step, loss, norm))
                    self.optimizer.update_all(step, params, grads)
                    if due or len(pending) >= DEPTH:
                        read_pending()

                if shown:
                    dt = time.perf_counter() - t0
                    self.hub.emit(
                        TrainStep(
                            done,
                            cfg.train_steps,
                            epoch,
                            window_loss / max(window_steps, 1),
                            lr,
                            window_steps * cfg.data.batch_size / max(dt, 1e-9),
                            grad_norm,
                        )
                    )
                    window_loss, window_steps, t0 = 0.0, 0, time.perf_counter()
                if evaluated:
                    metrics = evaluate_splits(
                        self.net, params, state, self.splits, cfg.data.eval_batch_size, xp
                    )
                    self.hub.emit(Evaluated(done, cfg.train_steps, metrics))
                    t0 = time.perf_counter()  # evaluation time is not training throughput
                if cfg.checkpoint_due(done):
                    save(done)
                    t0 = time.perf_counter()
            settle()
            if end < cfg.train_steps:
                save(end)  # stopped at `until`: a checkpoint to go on from
            else:
                save(cfg.train_steps, final=True)
        result.params = {k: K.to_numpy(v) for k, v in params.items()}
        result.state = {k: K.to_numpy(v) for k, v in state.items()}
        return result

    def _graph_step(self, params: dict, state: dict) -> GraphStep | None:
        """The GPU step as CUDA graphs where the job (``gpu.graphs``) or ``RAYSINGA_GPU_GRAPHS``
        asks for them; None on the CPU (a notice says so where they were asked for). Kept as
        ``self.graphs`` (its ``replays`` count the steps a graph ran)."""
        mode = graphs_mode(self.cfg.gpu.graphs)
        if mode == "off":
            return None
        if self.device != "gpu":
            self.hub.notice("raysinga: gpu.graphs applies to GPU runs; this run is on the CPU")
            return None
        self.graphs = GraphStep(
            self.net,
            self.optimizer,
            params,
            state,
            self.cfg.clip_norm,
            self.hub.notice,
            mode,
        )
        return self.graphs


@contextlib.contextmanager
def weight_copies(params: dict, optimizer: Any) -> Iterator[precision.WeightCopies | None]:
    """Under the bf16 compute precision, bfloat16 copies of the weights in ``params`` for the
    duration of a run, which the optimizer writes as it updates the weights and the matrix
    products read (:class:`~raysinga.kernels.precision.WeightCopies`); None otherwise."""
    copies = precision.WeightCopies(params) if precision.compute() == "bf16" else None
    optimizer.bf16_copies = {} if copies is None else copies.words
    try:
        with precision.copies_in_use(copies):
            yield copies
    finally:
        optimizer.bf16_copies = {}


def _resolve_device(want: str, notice: Callable[[str], None]) -> str:
    """The job's ``device`` made concrete; an automatic choice that fell back to the CPU on a
    machine that looked meant for the GPU says why, in one line."""
    if want == "auto":
        dev = K.device()
        note = K.gpu_fallback_note() if dev == "cpu" else None
        if note and os.environ.get("RAYSINGA_DEVICE", "").strip().lower() in ("", "auto"):
            notice(note)
        return dev
    if want == "gpu" and not K.gpu_available():
        raise RuntimeError(
            f"device: gpu requested but no GPU is usable: {K.gpu_unavailable_reason()}"
        )
    return want


def open_data(cfg: JobConfig, net: Net, log: Callable[[str], None]) -> Splits:
    """The training, validation and test splits, checked against the model and each other
    before step 0: a mistake in the data is refused now, not after minutes of training (or at
    the final evaluation). Splits too large to scan whole are sampled, and the log says so."""
    source = cfg.data.source
    splits = open_splits(source, cfg.data.held_out())
    notes = check_splits(
        splits.train,
        splits.test,
        input_shape=net.spec.input_shape,
        output_shape=net.output_shape,
        loss=net.spec.loss,
        batch_size=cfg.data.batch_size,
        scan_bytes=cfg.data.scan_bytes,
        source=source,
    )
    for note in notes:
        log(f"raysinga: {note}")
    _check_fits(net, splits.train)
    _check_best(cfg, net, splits)
    return splits


def _check_best(cfg: JobConfig, net: Net, splits: Splits) -> None:
    """``checkpoint.keep_best`` names a metric that this model and these splits measure."""
    best = cfg.checkpoint.keep_best
    if best is None:
        return
    split, _, metric = best.partition("_")
    if split not in splits.held_out():
        raise ValueError(
            f"checkpoint.keep_best: {best} needs a test split; data.source "
            f"(kind {cfg.data.source.get('kind')}) has none (give it a 'test' entry, or use "
            "data.validation and valid_" + metric + ")"
        )
    measured = {"loss": True, "accuracy": net.classifies}
    measured["bits"] = net.spec.loss == "sequence_cross_entropy"
    if not measured[metric]:
        raise ValueError(
            f"checkpoint.keep_best: {best}: loss {net.spec.loss} has no {metric}; use {split}_loss"
        )


def _check_fits(net: Net, data: Dataset) -> None:
    if tuple(data.sample_shape) != tuple(net.spec.input_shape):
        raise ValueError(
            f"model.input_shape {list(net.spec.input_shape)} does not match the data's sample "
            f"shape {list(data.sample_shape)}; set data.source.sample_shape or the model's input"
        )
    classes = getattr(data, "num_classes", None)
    want = {
        "softmax_cross_entropy": (classes,),
        "sequence_cross_entropy": (*tuple(data.sample_shape)[:1], classes),
    }.get(net.spec.loss)
    if classes and want is not None and net.output_shape != want:
        raise ValueError(
            f"model.layers[{len(net.spec.layers) - 1}]: the net's output shape "
            f"{list(net.output_shape)} does not match the {classes} classes of data.source "
            f"(loss {net.spec.loss} wants {list(want)})"
        )


def read_back(xp: Any, steps: list[tuple[int, Any, Any]]) -> list[tuple[int, float, float | None]]:
    """``(step, loss, norm)`` of steps whose loss and norm (or None) are 0-d device arrays,
    read to the host in one copy (one wait for the device, not one per value)."""
    values = [v for _, loss, norm in steps for v in (loss, norm) if v is not None]
    host = iter(K.to_numpy(xp.stack([xp.asarray(v, dtype=xp.float64) for v in values])).tolist())
    return [(step, next(host), None if norm is None else next(host)) for step, _, norm in steps]
