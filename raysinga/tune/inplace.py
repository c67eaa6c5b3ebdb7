"""Trials that keep their process: a raysinga job as a Ray Tune class trainable whose exploits
happen in place.

``tune.Tuner(raysinga.tune.in_place("job.yaml"), tune_config=tune.TuneConfig(
scheduler=raysinga.tune.InPlacePBT(...), reuse_actors=True))``. Each trial's process builds one
:class:`~raysinga.run.trainer.Trainer` (the net, the data, the compiled kernels) and runs it on a
thread of its own, held at every report until Tune asks for the next one. When
:class:`~raysinga.tune.InPlacePBT` copies a better trial into this one, it calls
:meth:`InPlaceTrial.exploit` in this process with the new hyperparameters and the better trial's
pointer: the trial's run is ended at its report, and a new run of the same trainer starts from
the better trial's tensors, read from Ray's object store (zero-copy on the same node, copied once
into the arrays the optimizer updates), under the new hyperparameters. Nothing restarts. Tune's
own way (a pause, then :meth:`InPlaceTrial.reset_config` and :meth:`InPlaceTrial.load_checkpoint`
on a process it reuses) works too, and loads nothing where the trial goes on in its own process
from its own newest report.

A report holds the run before the checkpoint's commit; the next step, or Tune's save, lets the
commit into the node's shared memory happen, and an exploit skips it. The node's keeper puts a
committed checkpoint into the object store while the next steps run, and a disk copy
(``checkpoint_dir=``) is written in the background too. Tune receives the pointer when it asks
for a checkpoint (PBT's save of a good trial, a pause, the final result) at once; a trial that
reads it before the keeper is done waits for the keeper. The final result's Tune checkpoint
holds the checkpoint's files too (``final_copy``), so a search's results outlive the Ray that
ran it.

Lineage, retention (``keep``) and replay are those of :func:`raysinga.tune.trainable`.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from raysinga import config
from raysinga.checkpoint import Checkpoint, CheckpointError
from raysinga.checkpoint.format import MANIFEST
from raysinga.obs.events import Evaluated, Event, TrainStep
from raysinga.run.state import run_info

from .events import TrialReported, TrialStarted
from .handover import Handover, held_steps
from .lineage import POINTER, continue_lineage, job_for, last_metrics
from .release import SHM_ROOT, drop_earlier
from .trials import Reporter, TrialSpec, fetch_newest, trial_spec

try:
    from ray import tune
except ImportError as e:  # Ray without its tune extra
    raise ImportError(
        f"raysinga.tune needs Ray Tune: pip install 'raysinga[tune]' ({type(e).__name__}: {e})"
    ) from None

__all__ = ["InPlaceTrial", "in_place"]


def in_place(
    job: str | os.PathLike | Mapping[str, Any],
    overrides: Sequence[str] = (),
    *,
    report_every: int | None = None,
    keep: int = 2,
    checkpoint_dir: str | None = None,
    log: bool = False,
    final_copy: bool = True,
    on_event: Callable[[str, Event], None] | None = None,
) -> type[InPlaceTrial]:
    """A Ray Tune class trainable running ``job`` (a job file or dict, with ``overrides`` as
    ``--set`` takes them), each trial's hyperparameters its ``param_space`` values as dotted job
    keys. Run it with ``TuneConfig(reuse_actors=True)``, so that Tune keeps a trial's process
    when PBT copies another trial into it. ``report_every``, ``keep``, ``checkpoint_dir`` and
    ``log`` are :func:`raysinga.tune.trainable`'s. ``final_copy``: the final result's Tune
    checkpoint holds the checkpoint's files, which Tune copies to its storage. ``on_event``
    (picklable; it runs in the trial's process): ``on_event(trial_id, event)`` for every event
    of the trial's runs and a :class:`TrialReported` at each report."""
    spec = trial_spec(
        job, overrides, report_every, keep, checkpoint_dir, log, "object_store", on_event
    )
    if config.from_dict(spec.job).topology is not None:
        raise config.ConfigError(
            "raysinga.tune.in_place runs each trial in its own process: set topology: null "
            "(a job with a topology runs through raysinga.tune.trainable)"
        )
    return type(
        "RaysingaTrial",
        (InPlaceTrial,),
        {"spec": spec, "final_copy": final_copy},
    )


class _Halt(BaseException):
    """Ends a run held at a report (the trial is reset, restored or stopped). Not an Exception:
    nothing on the way up may take it for a failure of the run."""


class _Segment:
    """One run of the trial's trainer on a thread of its own, from a start (fresh, or forked
    from a checkpoint) to its end. At every report it holds before the checkpoint's commit:
    :meth:`next_report` lets it go on (to commit, and on to the next report), :meth:`commit`
    lets it commit and hold again (Tune asks for the checkpoint), :meth:`halt` ends it there (an
    exploit: the checkpoint of a state about to be replaced is never written)."""

    def __init__(self, fit: Callable[[], Any]) -> None:
        self.reports: queue.Queue = queue.Queue()
        self.orders: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(fit,), daemon=True)
        self.held: str | None = None  # "report" (before its commit) or "committed"
        self.committed: dict[str, Any] | None = None  # the held report's checkpoint
        self.over = False

    def _run(self, fit: Callable[[], Any]) -> None:
        try:
            fit()
        except _Halt:
            self.reports.put(("halted", None))
        except BaseException as e:  # noqa: BLE001 - handed to the thread Tune calls us on
            self.reports.put(("error", e))
        else:
            self.reports.put(("finished", None))

    def hold(self, kind: str, value: dict[str, Any]) -> str:
        """In the run's thread: hand ``value`` over (a ``report`` or the ``committed``
        checkpoint of one) and wait for the order, which is returned ("go", "commit")."""
        self.held = kind
        self.reports.put((kind, value))
        order = self.orders.get()
        self.held = None
        if order == "halt":
            raise _Halt
        return order

    def _next(self, kind: str) -> dict[str, Any] | None:
        got, value = self.reports.get()
        if got == kind:
            return value
        self.over = True
        self.thread.join()
        if got == "error":
            raise value
        return None

    def next_report(self) -> dict[str, Any] | None:
        """Run on to the next report and return it (None where the run ended without one)."""
        if self.over:
            return None
        if self.thread.ident is None:
            self.thread.start()
        else:
            self.orders.put("go")
        self.committed = None
        return self._next("report")

    def commit(self) -> dict[str, Any] | None:
        """The held report's checkpoint (``step``, ``path``), committed now where it is not."""
        if self.committed is None and self.held == "report":
            self.orders.put("commit")
            self.committed = self._next("committed")
        return self.committed

    def halt(self) -> None:
        if self.thread.ident is None or self.over:
            return
        self.orders.put("halt")
        while self.reports.get()[0] in ("report", "committed"):  # one under way is dropped
            self.orders.put("halt")
        self.over = True
        self.thread.join()


class _HeldReporter(Reporter):
    """The reports of an in-place trial's run. At a report step the run holds after the
    step's last event (its evaluation, or its training window) and before the checkpoint's
    commit; the committed checkpoint goes to the object store in the background
    (:class:`.handover.Handover`). Where a report step shows no event, the run holds after
    the commit instead."""

    segment: _Segment
    handover: Handover
    emit: Callable[[Event], None]
    # the kind of event a report step's last before its commit is (None: it shows none)
    hold_point: Callable[[int], type | None]
    commit_next: bool = False  # hold once the next checkpoint is committed

    def __call__(self, ev: Event) -> None:
        super().__call__(ev)  # metrics; a commit goes to report()
        if isinstance(ev, (TrainStep, Evaluated)) and type(ev) is self.hold_point(ev.step):
            order = self.segment.hold("report", self.result(ev.step))
            self.commit_next = order == "commit"

    def result(self, step: int) -> dict[str, Any]:
        parent = self.lineage[-1]["from"]
        forked_from = "" if parent is None else f"{parent['trial']}@{parent['step']}"
        self.emit(TrialReported(self.trial, step, os.getpid(), 0.0, len(self.lineage), forked_from))
        return {
            **self.metrics,
            "step": step,
            "segments": len(self.lineage),
            "forked_from": forked_from,
            "finished": step >= self.total,
            "done": step >= self.total,
            "pid": os.getpid(),
            # Tune asks for the final checkpoint; PBT asks for the others it needs
            **({"should_checkpoint": True} if step >= self.total else {}),
        }

    def report(self, step: int, path: str) -> None:
        self.handover.start(step, path, self.lineage)
        committed = {"step": step, "path": path}
        if self.commit_next:  # Tune waits for this checkpoint
            self.commit_next = False
            self.segment.hold("committed", committed)
        elif self.hold_point(step) is None:  # no event to hold at before the commit: here
            order = self.segment.hold("report", self.result(step))
            if order == "commit":
                self.segment.hold("committed", committed)


class InPlaceTrial(tune.Trainable):
    """The class trainable :func:`in_place` makes (its ``spec`` set there)."""

    spec: TrialSpec
    final_copy: bool = True

    # ------------------------------------------------------------------ Tune's calls
    def setup(self, config: dict[str, Any]) -> None:
        self._trainer: Any = None
        self._segment: _Segment | None = None
        self._handover: Handover | None = None
        self._params = dict(config)
        self._source: tuple[Checkpoint, dict[str, Any]] | None = None
        self._restart = True  # the next step starts a run (fresh, or from self._source)
        self._last: dict[str, Any] | None = None  # the newest report
        self._say = print if self.spec.log else (lambda line: None)
        self._failure: Exception | None = None  # of an exploit, raised by the next step
        self._how = "fresh"  # how the next run starts (TrialStarted)
        self._tidying: list[threading.Thread] = []  # ended runs' working copies, on their way

    def step(self) -> dict[str, Any]:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if self._restart:
            self._start()
        assert self._segment is not None
        result = self._segment.next_report()
        if result is None:
            raise RuntimeError(f"trial {self.trial_id}: its run ended without a report")
        self._last = result
        return result

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        if self._restart and self._source is not None:
            # taken over and not stepped since (Tune pauses a trial it has just exploited where
            # others wait): its state is the checkpoint it took
            Path(checkpoint_dir, POINTER).write_text(json.dumps(self._source[1]))
            return
        if self._last is None:
            raise CheckpointError(f"trial {self.trial_id}: no report yet, nothing to save")
        assert self._handover is not None and self._segment is not None
        committed = self._segment.commit()
        if committed is None or committed["step"] != self._last["step"]:
            raise CheckpointError(
                f"trial {self.trial_id}: its run ended before step {self._last['step']}'s "
                "checkpoint was committed"
            )
        step = committed["step"]
        if not self._last["finished"]:  # PBT's save of a good trial: the reader waits, if any
            pointer = self._handover.pointer(step)
        else:  # the search's result: whole where it ends
            pointer = self._handover.finish(step, disk=True)
        if self.final_copy and self._last["finished"]:
            for f in Path(committed["path"]).iterdir():
                shutil.copyfile(f, Path(checkpoint_dir, f.name))
        Path(checkpoint_dir, POINTER).write_text(json.dumps(pointer))

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        from .lineage import read_pointer  # noqa: PLC0415

        pointer = read_pointer(checkpoint_dir)
        last = self._last
        if (
            not self._restart
            and last is not None
            and self._handover is not None
            and self._handover.key == pointer["key"]
            and int(last["step"]) == int(pointer["step"])
        ):
            return  # its own newest report, under the same hyperparameters: it goes on
        if Path(checkpoint_dir, MANIFEST).is_file():  # a final copy (mapped: Tune may delete it)
            source, used = Checkpoint.open(checkpoint_dir, verify="full"), pointer
        else:
            source, used, _ = fetch_newest(pointer, self._say, here=True)
        self._source, self._restart, self._how = (source, used), True, "restore"

    def exploit(self, new_config: dict[str, Any], checkpoint: Any, metrics: dict) -> None:
        """Take another trial's state (its Tune ``checkpoint``, with the ``metrics`` of its
        report) under ``new_config``, in this process (:class:`~raysinga.tune.InPlacePBT`): the
        run is ended at its report and the next step starts from that state. An error is
        raised by that step."""
        try:
            self.config = dict(new_config)
            self.reset_config(new_config)
            with checkpoint.as_directory() as d:
                self.load_checkpoint(d)
            self._how = "exploit"
            self._iteration = metrics.get("training_iteration", self._iteration)
        except Exception as e:  # noqa: BLE001 - raised by the next step, which fails the trial
            self._failure = e

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        """Another trial's hyperparameters (PBT's exploit, or Tune handing this process to
        another trial): the run is ended at its report, the trainer kept."""
        self._params = dict(new_config)
        self._source, self._restart, self._last, self._how = None, True, None, "fresh"
        return True

    def cleanup(self) -> None:
        if self._segment is not None:
            self._segment.halt()
        for t in self._tidying:
            t.join()

    # ------------------------------------------------------------------ one run
    def _start(self) -> None:
        """End the current run and start the next: from ``self._source`` or fresh, with this
        trial's hyperparameters, on the trainer this process built (or a new one where the
        model or data differ)."""
        from raysinga.run.trainer import Trainer  # noqa: PLC0415

        if self._segment is not None:
            self._segment.halt()
        source, pointer = self._source or (None, None)
        trial, experiment = self.trial_id, self._trial_info.experiment_name
        spec = self.spec
        lineage = continue_lineage(pointer, trial, self._params)
        incarnation = f"{trial}-{uuid.uuid4().hex[:8]}"
        if self._segment is None:  # what earlier processes of this trial left on this node
            drop_earlier(Path(SHM_ROOT, experiment), trial)
        where = str(Path(SHM_ROOT, experiment, incarnation))
        base = config.from_dict(spec.job)
        cfg = job_for(
            spec.job,
            self._params,
            name=f"{base.name}-{trial}",
            run_dir=str(Path(self.logdir, "raysinga")),
            checkpoint_frequency=spec.report_every,
            test_freq=spec.report_every if base.test_freq == 0 else base.test_freq,
            # two: the keeper still reads the one before while the newest is committed
            **{"checkpoint.dir": where, "checkpoint.keep_last": 2},
            **{"checkpoint.object_store": False, "checkpoint.final": True},
            **({} if "divergence" in spec.job else {"divergence.factor": None}),
        )
        Path(cfg.run_path).mkdir(parents=True, exist_ok=True)
        Path(cfg.run_path, "lineage.json").write_text(json.dumps(lineage, indent=1))
        key = f"tune/{experiment}/{trial}"
        disk = (
            f"{spec.checkpoint_dir.rstrip('/')}/{experiment}/{incarnation}"
            if (spec.checkpoint_dir)
            else None
        )
        self._handover = Handover(key, trial, spec.keep, disk, held_steps(key))
        reporter = _HeldReporter(key, trial, lineage, spec.keep, bool(disk), total=cfg.train_steps)
        if source is not None:  # until its own first report: the metrics of the state it took
            reporter.metrics = last_metrics(run_info(source)["history"])
        handover = reporter.handover = self._handover
        observer = spec.on_event
        reporter.emit = (lambda ev: observer(trial, ev)) if observer else (lambda ev: None)

        def on_event(ev: Event) -> None:
            if observer is not None:
                observer(trial, ev)
            reporter(ev)

        if self._trainer is None or not _same_run(self._trainer.cfg, cfg):
            self._trainer = Trainer(cfg, log=self._say, on_event=on_event, fork_from=source)
        else:
            _rearm(self._trainer, cfg, source, self._say, on_event)
        trainer = self._trainer

        def fit() -> None:
            try:
                trainer.fit()
            finally:  # the next run (an exploit's) need not wait for the keeper
                tidy = threading.Thread(target=_tidy, args=(handover, where), daemon=True)
                tidy.start()
                self._tidying.append(tidy)

        def hold_point(step: int) -> type | None:  # as the trainer's loop decides
            if not cfg.checkpoint_due(step) and step != cfg.train_steps:
                return None
            if cfg.evaluation_due(step) and trainer.splits.held_out():
                return Evaluated
            return TrainStep if step % cfg.disp_freq == 0 or step == cfg.train_steps else None

        reporter.hold_point = hold_point
        step = 0 if pointer is None else int(pointer["step"])
        reporter.emit(TrialStarted(trial, step, os.getpid(), self._how))
        reporter.segment = self._segment = _Segment(fit)
        self._restart, self._source = False, None


def _tidy(handover: Handover, where: str) -> None:
    """After a run: its checkpoints on their way into the object store arrive (the keeper reads
    them from ``where``), then its working copies go."""
    try:
        handover.close()
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _same_run(a: config.JobConfig, b: config.JobConfig) -> bool:
    """Whether a trainer built for job ``a`` can run job ``b``: the same model, data (and so
    batch plan), dtype, device and seed; the optimizer may differ."""
    keys = ("model", "data", "dtype", "device", "seed", "precision")
    return all(a.raw.get(k) == b.raw.get(k) for k in keys)


def _rearm(trainer: Any, cfg: config.JobConfig, source: Any, log: Any, on_event: Any) -> None:
    """Make ``trainer`` run ``cfg`` next, from ``source`` (None: fresh): its net, data, batch
    plan and compiled kernels stay, its job, optimizer and start change (what
    :class:`Trainer`'s constructor sets for them)."""
    from raysinga.obs.console import hub_for  # noqa: PLC0415
    from raysinga.optim.optimizers import make_optimizer  # noqa: PLC0415

    trainer.cfg = cfg
    trainer.resume, trainer.init_from, trainer.fresh = False, None, False
    trainer.fork_from, trainer.until = source, None
    trainer.optimizer = make_optimizer(cfg.optimizer)
    trainer.run_dir = Path(cfg.run_path)
    trainer.hub = hub_for(log, on_event)
    trainer.graphs = None
