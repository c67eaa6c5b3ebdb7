"""One run session, shared by the single-process trainer and the distributed controller.

A session holds what does not depend on how steps are run: the run's writer lock, the decision
of what the run starts from (fresh, resume, auto-resume, ``--init-from``), the stop signals, and
the bookkeeping of committed checkpoints (which steps hold which groups' state, pruning, the
object-store copies). A trainer opens one, asks it where to start, runs steps, and tells it what
it committed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raysinga.checkpoint import Checkpoint, CheckpointError, storage, writer
from raysinga.checkpoint.lock import RunLock
from raysinga.checkpoint.manage import prune, steps
from raysinga.checkpoint.storage import Location
from raysinga.data import identity as data_identity
from raysinga.data.cursor import DataCursor
from raysinga.obs.events import CheckpointCommitted, Evaluated, EventHub
from raysinga.obs.metrics import TrainResult

from . import record as run_record
from . import registry as run_registry
from . import sources as run_sources
from . import tracking
from .divergence import Diverged, Guard
from .prune import BackgroundPrune
from .record import RESOLVED_JOB
from .sources import Source, set_aside
from .state import check_fits, cursor_for, run_info


class Preempted(Exception):
    """Training stopped on a signal (SIGTERM, Ctrl-C) after checkpointing, so that it resumes."""

    def __init__(self, signum: int, step: int, path: str | None) -> None:
        self.signum, self.step, self.path = signum, step, path
        where = f"checkpoint {path}" if path else "no checkpoint (checkpoint.final off)"
        super().__init__(
            f"stopped by {signal.Signals(signum).name} at step {step}; {where}; "
            "continue with --resume"
        )


def in_ray_working_dir_copy(where: str) -> bool:
    """Whether a local path lies in the copy of a job's working directory that Ray unpacks
    under its session's ``runtime_resources`` (``ray job submit --working-dir``): a relative
    ``run_dir`` left at its default lands there, and is lost with it."""
    if "://" in where:
        return False
    parts = Path(where).resolve().parts
    return "runtime_resources" in parts and any(p.startswith("working_dir_files") for p in parts)


def check_start_options(resume: Any, init_from: Any, fresh: bool, fork_from: Any = None) -> None:
    """``resume``: True, False, "auto" or a path (a ``step-N`` checkpoint of the run, to go on
    from instead of the newest); it, ``init_from``, ``fork_from`` and ``fresh`` exclude one
    another."""
    if resume not in (False, True, "auto") and not isinstance(resume, (str, os.PathLike)):
        raise ValueError(f"resume must be True, False, 'auto' or a path, got {resume!r}")
    if sum(map(bool, (resume, init_from is not None, fork_from is not None, fresh))) > 1:
        raise ValueError("resume, init_from, fork_from and fresh exclude one another")


@dataclass
class Start:
    """What a run starts from: nothing (``fresh``), a checkpoint of this run (``resume``: its
    run state in ``info``), another run's whole state under this job's hyperparameters
    (``fork``: as a resume, but the optimizer's hyperparameters and schedule are the job's, not
    the checkpoint's) or another checkpoint's parameters (``init``: those in ``names``)."""

    kind: str
    seed: int
    source: Source | None = None
    checkpoint: Checkpoint | None = None
    info: dict[str, Any] | None = None
    names: dict[str, str] = field(default_factory=dict)  # init: model name -> checkpoint name
    report: Any = None  # init: the MatchReport of the names

    @property
    def resumed(self) -> bool:
        """Whether the run goes on from a checkpoint's whole state (a resume or a fork)."""
        return self.kind in ("resume", "fork")

    def position(self, n_groups: int) -> tuple[list[int], DataCursor]:
        """Steps per group and the data cursor for ``n_groups`` groups."""
        if self.info is None:
            return [0] * n_groups, DataCursor()
        return cursor_for(self.info, n_groups)

    def history(self, upto: int) -> list[dict[str, Any]]:
        """The saved metric records up to step ``upto`` (a resume's or a fork's; else none). A
        fork's end with a record of where it forked from, so its checkpoints say so."""
        if self.info is None:
            return []
        kept = [r for r in self.info["history"] if r.get("step", 0) <= upto]
        if self.kind == "fork" and self.checkpoint is not None:
            label = self.source.label if self.source is not None else ""
            kept.append(
                {"kind": "fork", "step": self.checkpoint.step, "from": storage.redact(label)}
            )
        return kept


class RunSession:
    """The lock, start decision, stop signals and commit bookkeeping of one run.

    Use as a context manager: entering takes the run's lock and decides :attr:`start`; leaving
    waits for the last prune and the object-store copies handed over, and releases the lock.
    """

    def __init__(
        self,
        cfg: Any,
        shapes: dict[str, tuple[int, ...]],
        dtype: Any,
        data: dict[str, Any],
        hub: EventHub,
        resume: bool | str = False,
        init_from: Any = None,
        fresh: bool = False,
        fork_from: Any = None,
    ) -> None:
        check_start_options(resume, init_from, fresh, fork_from)
        self.cfg, self.shapes, self.dtype, self.data, self.hub = cfg, shapes, dtype, data, hub
        self.resume, self.init_from, self.fresh = resume, init_from, fresh
        self.fork_from = fork_from
        self.root = storage.resolve(cfg.checkpoint_dir)
        self.lock: RunLock | None = None
        self.start = Start("fresh", cfg.seed)
        self.stop_signal: int | None = None
        # Checkpointed steps (made or resumed from), each with its groups' steps: asynchronous
        # groups at [T-2, T] are saved as step T, which the state [T, T] must later replace.
        self.saved_at: dict[int, tuple[int, ...]] = {}
        self.saved: list[dict[str, Any]] = []  # per commit: step, path, blocked, seconds
        self.adopting: list[Any] = []  # the object-store registry's calls still running
        self.pruning = BackgroundPrune()  # the prune after the last commit, still running
        # the running launch's divergence guard: pruning keeps its newest healthy checkpoint,
        # and a divergence sets the newer ones aside as the session ends
        self.guard: Guard | None = None
        # checkpoint.keep_best: its metric's value at each evaluated step (of this run and,
        # before a resume, of its history)
        self.scores: dict[int, float] = {}
        # the job's mlflow: what ends its subscriber (run.tracking), where it has one
        self.end_tracking: Any = None
        self.final: dict[str, Any] | None = None
        if cfg.checkpoint.keep_best:
            hub.subscribe(self._scored)
        places = [("run_dir", cfg.run_path), ("checkpoint.dir", cfg.checkpoint.dir)]
        for what, where in places:
            if where and in_ray_working_dir_copy(where):
                hub.notice(
                    f"raysinga: warning: {what} {Path(where).resolve()} is inside Ray's temporary "
                    "copy of the job's working directory, which Ray deletes; set it to a lasting "
                    f"place (--set {what}=PATH)"
                )

    def log(self, text: str) -> None:
        self.hub.notice(text)

    # ------------------------------------------------------------------ the start
    def __enter__(self) -> RunSession:
        try:
            self.lock = RunLock(self.root, notice=self.log).acquire()
        except CheckpointError:
            raise
        except OSError as e:  # the first write of the run: a place that cannot be written
            raise CheckpointError(f"checkpoint.dir {self.root} cannot be written: {e}") from None
        try:
            self.start = self._decide()
            for rec in self.start.info["history"] if self.start.resumed else ():
                self._score(rec)
            self._keep_job()
            self.end_tracking = tracking.track(self.cfg, self.start, self.hub)
        except BaseException:
            self._release()
            raise
        return self

    def _keep_job(self) -> None:
        """``<run_dir>/job.resolved.yaml``: the job as this run (its latest start) runs it,
        after ``--set`` and the command line's other changes; part of the run's record.
        Credentials in its URIs are left out, as in every file and log line of the run."""
        run_dir = Path(self.cfg.run_path)
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".{RESOLVED_JOB}.{os.getpid()}"
        tmp.write_text(yaml.safe_dump(storage.redact_all(self.cfg.raw), sort_keys=False))
        os.replace(tmp, run_dir / RESOLVED_JOB)

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if self.end_tracking is not None:
            self.end_tracking(exc, isinstance(exc, (Preempted, KeyboardInterrupt)), self.final)
        try:
            self.pruning.close(self.log if exc is not None else None)
            if isinstance(exc, Diverged):
                self._set_aside_diverged(exc)
            run_registry.wait_adopted(self.adopting, self.log)
            self.keep_record()
        finally:
            self._release()

    def finish(self, result: TrainResult) -> TrainResult:
        """``result`` with where the run's newest checkpoint is (the last committed, or the
        one resumed from where none was) and the ``init_from`` match report."""
        if self.saved:
            result.checkpoint, result.checkpoint_step = (
                self.saved[-1]["path"],
                self.saved[-1]["step"],
            )
        elif self.start.resumed and self.start.checkpoint is not None:
            ck, src = self.start.checkpoint, self.start.source
            where = ck.location if ck.location is not None else getattr(src, "label", None)
            result.checkpoint, result.checkpoint_step = str(where), ck.step
        result.init_report = self.start.report
        ev = result.final_eval  # what the MLflow run ends with
        self.final = {k: v for k, v in (ev or {}).items() if k not in ("kind", "time")}
        # of those on disk: a run that set keep_best only on its resume pruned some before
        best = self.best(steps(self.root)) if self.cfg.checkpoint.keep_best else None
        if best is not None:
            metric = self.cfg.checkpoint.keep_best
            here = [x["path"] for x in self.saved if x["step"] == best]
            path = here[-1] if here else str(self.root.join(f"step-{best}"))
            result.best = {"step": best, "metric": metric, "value": self.scores[best], "path": path}
        return result

    def keep_record(self) -> None:
        """Copy the run's record beside its checkpoints (:mod:`.run_record`); a failure is
        told, not raised: the checkpoints themselves are what a resume needs."""
        try:
            run_record.mirror(Path(self.cfg.run_path), self.root)
        except OSError as e:
            self.log(f"raysinga: could not copy the run's record to {self.root}: {e}")

    def check_lock(self) -> None:
        """Before a commit: raise CheckpointError where another writer took the run over."""
        if self.lock is not None:
            self.lock.check()

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _decide(self) -> Start:
        cfg = self.cfg
        src, ck = run_sources.open_run(self.root, cfg, self.resume, self.fresh, self.log)
        if src is not None and ck is not None:
            return self.adopt(src, ck)
        if self.fork_from is not None:
            src = run_sources.init_source(self.fork_from)
            return self.adopt(src, src.open(verify="fast"), kind="fork")
        if self.init_from is not None:
            init = cfg.init
            src, ck, names, report = run_sources.open_init(
                self.init_from, self.shapes, self.log, init.rename, init.strip_prefix
            )
            return Start("init", cfg.seed, src, ck, names=names, report=report)
        return Start("fresh", cfg.seed)

    def adopt(self, src: Source, ck: Checkpoint, kind: str = "resume") -> Start:
        """Start from ``ck``, a checkpoint of this run (or, ``kind="fork"``, of another run
        whose state this one goes on from): it must fit the model, dtype and data."""
        info = run_info(ck)
        check_fits(ck, self.shapes, self.dtype)
        data_identity.check_resume(ck, info, self.data)
        steps_at = tuple(int(s) for s in info["steps"])
        if kind == "resume":  # a fork commits its own steps, in a checkpoint root of its own
            self.saved_at = {ck.step: steps_at}
        start = Start(kind, int(info["rng"]["seed"]), src, ck, info)
        what = "resuming" if kind == "resume" else "forking"
        self.log(f"raysinga: {what} {self.cfg.name!r} at step {max(steps_at)} from {src.label}")
        return start

    def verify(self, verifier: Callable[[Source, Checkpoint], None]) -> Start:
        """Hash the start checkpoint's files in full (``verifier(src, ck)`` raises
        CheckpointError). A resume from a corrupt checkpoint falls back to the next older
        valid one; an ``--init-from`` checkpoint has no fallback."""
        s = self.start
        if s.source is None or s.checkpoint is None:
            return s
        if s.kind != "resume":  # another run's checkpoint: no older one of it to fall back to
            verifier(s.source, s.checkpoint)
            return s
        src, ck = run_sources.verify_start(
            self.root, self.cfg, s.source, s.checkpoint, verifier, self.log
        )
        if ck is not s.checkpoint:
            self.start = self.adopt(src, ck)
        return self.start

    def newest(self) -> Start:
        """Where a restart (after a lost role, or to resize) begins: the newest committed
        checkpoint (the object store's copy when it is at least as new as the newest on
        disk), else the run's own start again."""
        self.pruning.settle()
        src, ck, _ = run_sources.find_resume(
            self.root, self.cfg.name, self.cfg.checkpoint.object_store
        )
        if src is not None and ck is not None:
            self.start = self.adopt(src, ck)
        elif self.start.kind == "resume":  # resumed, but its checkpoint is gone since
            raise CheckpointError(f"{self.root}: the checkpoint this run resumed from is gone")
        else:  # nothing committed yet: from the start (or the --init-from checkpoint) again
            self.saved_at = {}
        return self.start

    # ------------------------------------------------------------------ stop signals
    @contextlib.contextmanager
    def stop_signals(self) -> Iterator[None]:
        """SIGTERM (preemption, ``ray job stop``) or Ctrl-C: the trainer finishes the steps
        under way, checkpoints and stops (:attr:`stop_signal` is set). A second signal stops at
        once. Inside a Ray task or actor, or off the main thread, signals are not ours."""
        if threading.current_thread() is not threading.main_thread() or _in_ray_worker():
            yield
            return

        def on_signal(signum: int, frame: Any) -> None:
            if self.stop_signal is not None:
                for sig, h in old.items():
                    signal.signal(sig, h)
                raise KeyboardInterrupt
            self.stop_signal = signum
            self.log(
                f"raysinga: {signal.Signals(signum).name}: stopping at the next step boundary"
                + (" after a checkpoint" if self.cfg.checkpoint.final else "")
                + "; signal again to stop at once"
            )

        old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)

    def preempted(self, step: int) -> Preempted:
        """The error that ends a run stopped by a signal at ``step``."""
        last = self.saved[-1] if self.saved else None
        path = last["path"] if last is not None and last["step"] == step else None
        return Preempted(self.stop_signal or signal.SIGTERM, step, path)

    # ------------------------------------------------------------------ commits
    def _scored(self, ev: Any) -> None:
        if isinstance(ev, Evaluated):
            self._score(ev.record())

    def _score(self, rec: dict[str, Any]) -> None:
        """Note a metric record's ``keep_best`` value."""
        metric = self.cfg.checkpoint.keep_best
        if rec.get("kind") == "eval" and metric in rec:
            self.scores[rec["step"]] = rec[metric]

    def best(self, there: list[int]) -> int | None:
        """The step of the best checkpoint by ``checkpoint.keep_best`` among steps ``there``
        (those on disk). Ties go to the earliest step."""
        scored = [s for s in there if s in self.scores]
        if not scored:
            return None
        sign = -1.0 if self.cfg.checkpoint.best_is_max else 1.0
        return min(scored, key=lambda s: (sign * self.scores[s], s))

    def replaces(self, step: int, steps: tuple[int, ...]) -> bool | None:
        """Whether a checkpoint of ``step`` holding the groups at ``steps`` replaces one
        already committed (True) or is new (False); None when that exact state is saved."""
        if self.saved_at.get(step) == steps:
            return None
        return step in self.saved_at

    def staging(self, step: int, replace: bool) -> Location:
        """The temporary directory a checkpoint of ``step`` is written into
        (:func:`.checkpoint.writer.begin`), once the last prune is done."""
        self.pruning.settle()
        return writer.begin(self.root, step, replace=replace)

    def committed(
        self,
        step: int,
        steps: tuple[int, ...],
        path: str,
        blocked_s: float,
        seconds: float,
        in_background: bool,
    ) -> None:
        """Book a committed checkpoint: report it, hand it to the object-store registry
        (``checkpoint.object_store``) and prune older ones by the keep rules, in the
        background (:mod:`.background_prune`)."""
        self.saved_at[step] = steps
        self.saved.append({"step": step, "path": path, "blocked": blocked_s, "seconds": seconds})
        self.hub.emit(CheckpointCommitted(step, path, blocked_s, seconds, in_background))
        c = self.cfg.checkpoint
        best = self.best if c.keep_best else None
        # while the run goes on, the newest checkpoint from before any divergence is kept too
        # (the newest is not yet known to be); a finished run keeps what the rules say
        guarded = self.guard is not None and self.cfg.divergence.factor is not None
        floor = self.guard.safe if guarded and step < self.cfg.train_steps else None
        key = run_registry.key(self.cfg.name, self.root) if c.object_store else None
        if key is not None:
            run_registry.keep_in_object_store(key, step, path, self.adopting)

        def prune_older() -> None:
            deleted = prune(self.root, c.keep_last, c.keep_every, False, step, best, floor)
            if key is not None and deleted:  # the store holds what the directory holds
                run_registry.drop(key, deleted, wait=False)

        self.pruning.start(prune_older)
        self.keep_record()

    def _set_aside_diverged(self, e: Diverged) -> None:
        """Checkpoints newer than ``e.safe`` hold states from after the divergence began: moved
        aside (``step-N.diverged-<id>``), and dropped from the object store where the run keeps
        copies there, so that the newest checkpoint from before it is the run's latest. ``e`` is
        told which that is."""
        root = self.root
        stored = self.cfg.checkpoint.object_store
        run_key = run_registry.key(self.cfg.name, root) if stored else None
        after = [s for s in steps(root) if s > e.safe]
        try:
            for s in after:
                set_aside(root, f"step-{s}", "diverged")
            if after and run_key is not None:
                run_registry.drop(run_key, after)
        except Exception as x:  # noqa: BLE001 - the divergence is what the user must hear of
            e.kept = f"but step(s) {after} from after it could not all be set aside ({x})"
            return
        there = steps(root)
        aside = f" ({len(after)} newer set aside as step-N.diverged-*)" if after else ""
        if there:
            e.kept = f"its latest checkpoint is step-{there[0]}, from before the divergence{aside}"
        else:
            e.kept = f"no checkpoint of it is from before the divergence{aside}"


def _in_ray_worker() -> bool:
    """Inside a Ray task or actor, where signals are Ray's to handle."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    return ray.get_runtime_context().worker.mode == ray.WORKER_MODE
