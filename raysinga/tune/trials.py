"""Hyperparameter search with Ray Tune: a raysinga job as a Tune trainable whose checkpoints are
handed from trial to trial through Ray's object store.

``tune.Tuner(raysinga.tune.trainable("job.yaml"), param_space={"updater.lr": ...})`` runs one
raysinga run per trial, its hyperparameters the job's dotted keys. At every ``report_every``
steps the trial evaluates, commits a checkpoint, puts it into the object store (owned by
raysinga's checkpoint registry, a detached actor, so it outlives the trial that made it) and
reports its metrics to Tune with a Tune checkpoint that is only a pointer: the registry key, the
step and the trial's lineage, a few hundred bytes. When population-based training (PBT) copies
a good trial into a bad one, the receiving trial reads the good one's tensors from the object
store (zero-copy on the same node) and goes on from its whole state (parameters, optimizer
state, data position, random stream) under its own new hyperparameters (:class:`Trainer`'s
``fork_from``). No checkpoint directory is written to disk unless ``checkpoint_dir`` asks for a
copy; the trial's working copy lives in the node's shared memory (``/dev/shm``).
``handover="tune_storage"`` hands checkpoints over the way Tune does by default instead: the
checkpoint directory itself is the Tune checkpoint, copied to the run's ``storage_path`` at every
report and read from there by the trial that takes it over (``benchmarks/bench_tune.py`` times
the two).

Every trial records its lineage: the segments of steps it (and the trials it forked from) ran,
each with its hyperparameters. :func:`replay` runs a lineage again, segment by segment, and ends
bit-identical to the trial.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raysinga import config
from raysinga.checkpoint import Checkpoint, CheckpointError, objstore
from raysinga.checkpoint.format import MANIFEST
from raysinga.obs.events import CheckpointCommitted, Evaluated, Event, TrainStep
from raysinga.run.state import run_info

try:
    import ray.tune  # noqa: F401 - the error below where Ray lacks its tune extra
except ImportError as e:  # Ray without its tune extra
    raise ImportError(
        f"raysinga.tune needs Ray Tune: pip install 'raysinga[tune]' ({type(e).__name__}: {e})"
    ) from None
from .events import TrialReported
from .handover import KEEPER_PREFIX  # noqa: F401 - where tests and tools look for it
from .handover import held_steps as _held_steps
from .handover import keeper as _keeper
from .handover import keepers as _keepers
from .lineage import (
    FORMAT,
    POINTER,
    continue_lineage,
    flat_overrides,
    job_for,
    last_metrics,
    load_job,
    read_pointer,
    replay,
)
from .release import SHM_ROOT, drop_earlier, placement_name

__all__ = [
    "POINTER",
    "fetch",
    "flat_overrides",
    "read_pointer",
    "replay",
    "trainable",
]

HANDOVERS = ("object_store", "tune_storage")


@dataclass(frozen=True)
class TrialSpec:
    """What every trial of a search shares: the job (as a dict, so that trials on any node
    need no job file), how often it reports, and where its checkpoints live."""

    job: dict[str, Any]
    report_every: int
    keep: int = 2
    checkpoint_dir: str | None = None
    log: bool = False
    handover: str = "object_store"
    on_event: Callable[[str, Event], None] | None = None  # (trial id, event), in the trial


def trainable(
    job: str | os.PathLike | Mapping[str, Any],
    overrides: Sequence[str] = (),
    *,
    report_every: int | None = None,
    keep: int = 2,
    checkpoint_dir: str | None = None,
    log: bool = False,
    handover: str = "object_store",
    on_event: Callable[[str, Event], None] | None = None,
) -> Callable[[dict[str, Any]], None]:
    """A Ray Tune function trainable running ``job`` (a job file or dict, with ``overrides``
    as ``--set`` takes them) once per trial, with the trial's ``param_space`` values applied as
    dotted job keys (``{"updater.lr": tune.loguniform(1e-4, 1e-1)}``; nested dicts work too).

    ``report_every``: steps between reports, each with an evaluation and a checkpoint (default:
    the job's ``checkpoint_frequency``, else ``test_freq``, else a tenth of the run).
    ``keep``: the newest checkpoints per trial kept in the object store. ``checkpoint_dir``: a
    path or URI where every trial also keeps a disk copy (used when an object is lost).
    ``log``: print the runs' console lines. ``handover``: how a checkpoint goes from trial to
    trial, ``"object_store"`` (a pointer to it is the Tune checkpoint) or ``"tune_storage"``
    (the checkpoint directory is the Tune checkpoint, which Tune copies to its storage; Tune's
    ``CheckpointConfig`` then decides how many are kept). ``on_event`` (picklable; it runs in
    the trial's process): ``on_event(trial_id, event)`` for every event of the trial's runs and
    a :class:`~raysinga.tune.events.TrialReported` as each report goes to Tune. The job is
    checked here, before any trial starts.
    """
    spec = trial_spec(job, overrides, report_every, keep, checkpoint_dir, log, handover, on_event)

    def raysinga_trial(params: dict[str, Any]) -> None:
        run_trial(spec, params)

    return raysinga_trial


def trial_spec(
    job: Any,
    overrides: Sequence[str],
    report_every: Any,
    keep: Any,
    checkpoint_dir: str | None,
    log: bool,
    handover: str,
    on_event: Callable[[str, Event], None] | None,
) -> TrialSpec:
    """The job checked and the arguments of :func:`trainable` as a :class:`TrialSpec`, each
    mistake an error naming it."""
    cfg = load_job(job, overrides)
    every = report_every or cfg.checkpoint_frequency or cfg.test_freq or -(-cfg.train_steps // 10)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"report_every must be a positive number of steps, got {report_every!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive number of checkpoints, got {keep!r}")
    if handover not in HANDOVERS:
        raise ValueError(f"handover must be one of {HANDOVERS}, got {handover!r}")
    return TrialSpec(cfg.raw, every, keep, checkpoint_dir, log, handover, on_event)


# ------------------------------------------------------------------------ pointers


def fetch(pointer: Mapping[str, Any], log: Callable[[str], None] = print) -> Checkpoint:
    """The checkpoint a pointer names: from the object store, or, where the object is lost,
    from its disk copy (saying so); an error naming both where neither is there."""
    return fetch_newest(pointer, log, newest=False)[0]


def fetch_newest(
    pointer: Mapping[str, Any],
    log: Callable[[str], None] = print,
    newest: bool = True,
    here: bool = False,
) -> tuple[Checkpoint, dict[str, Any], Any]:
    """As :func:`fetch`, with the pointer that was read and where the checkpoint is (its
    object-store ref, or its disk copy's URI), for roles in other processes to read.
    ``newest``: where the trial has released the step named (it kept training, and only its
    newest ``keep`` stay), its newest checkpoint instead, with that one's lineage: PBT copies
    the better trial as it is now. ``here``: only this process reads the checkpoint (an
    in-place trial), so a checkpoint still on its way into the object store is mapped from this
    node's shared memory where its trial wrote it here, instead of waited for."""
    import ray  # noqa: PLC0415
    from ray.exceptions import RayError  # noqa: PLC0415

    key, step, uri = pointer["key"], int(pointer["step"]), pointer.get("uri")
    why = "the registry has no entry for it"

    try:
        reg = objstore.registry()
        entry = ray.get(reg.lookup.remote(key, step))
        if entry is None and pointer.get("pending"):  # handed out while on its way in
            mapped = _mapped(pointer) if here else None
            if mapped is not None:  # a save of the state read says it is still on its way
                return mapped, dict(pointer), mapped.location.path
            entry = _registered(reg, key, step)
        if entry is None and newest and not uri:
            entry = ray.get(reg.lookup.remote(key, None))
            if entry is not None and entry["step"] > step and entry.get("meta"):
                log(
                    f"raysinga: {key} released step {step} since; "
                    f"taking its newest, step {entry['step']}"
                )
            else:
                entry = None
        if entry is not None:
            used = dict(pointer) if entry["step"] == step else dict(entry["meta"])
            return objstore.get(entry["refs"][0]), used, entry["refs"][0]
    except RayError as e:
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"
    if uri:
        log(f"raysinga: the object-store copy of {key} step {step} is lost ({why}); reading {uri}")
        return Checkpoint.open(uri, verify="full"), dict(pointer), uri
    held = ""
    with contextlib.suppress(Exception):  # what the registry holds of the trial, for the reader
        steps = _held_steps(key)
        held = f"; the registry holds steps {steps} of it" if steps else "; none of it"
    raise CheckpointError(
        f"{key} step {step}: the object-store copy is lost ({why}{held}) and there is no disk "
        "copy (set checkpoint_dir= of raysinga.tune.trainable to keep one)"
    )


def _mapped(pointer: Mapping[str, Any]) -> Checkpoint | None:
    """The committed files of a checkpoint still on its way into the object store, mapped from
    this node's shared memory where its trial ran here (no copy, no wait for the keeper), with
    the checks a resume makes; None where they are elsewhere or gone (the trial went on and
    pruned them: a mapped file outlives that, a file not yet mapped does not)."""
    import ray  # noqa: PLC0415

    shm = pointer.get("shm")
    if not isinstance(shm, dict) or shm.get("node") != ray.get_runtime_context().get_node_id():
        return None
    try:
        return Checkpoint.open(str(shm["path"]), verify="fast")
    except (OSError, CheckpointError):
        return None


def _registered(reg: Any, key: str, step: int, wait: float = 120.0) -> dict[str, Any] | None:
    """The registry's entry of a checkpoint that an in-place trial handed out before its
    node's keeper had it in the object store (:mod:`.handover`), once it is there."""
    import ray  # noqa: PLC0415

    deadline = time.monotonic() + wait
    while (entry := ray.get(reg.lookup.remote(key, step))) is None:
        newest = ray.get(reg.lookup.remote(key, None))
        if newest is not None and newest["step"] > step:
            return None  # registered in order: it was there, and has been released since
        if time.monotonic() > deadline:
            raise CheckpointError(f"{key} step {step}: not in the object store after {wait:.0f} s")
        time.sleep(0.01)
    return entry


# ------------------------------------------------------------------------ one trial


@dataclass
class Reporter:
    """Subscribes to a trial's run: at each committed checkpoint, hands it to the object store
    and reports the metrics since the last report to Tune, with a pointer to it."""

    key: str
    trial: str
    lineage: list[dict[str, Any]]
    keep: int
    disk: bool
    handover: str = "object_store"
    total: int = 0  # the job's train_steps
    metrics: dict[str, Any] = field(default_factory=dict)
    held: list[int] = field(default_factory=list)
    emit: Callable[[Event], None] = lambda ev: None  # noqa: E731 - an on_event of the trial

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, TrainStep):
            self.metrics.update(loss=ev.loss, lr=ev.lr, samples_per_s=ev.samples_per_s)
        elif isinstance(ev, Evaluated):
            self.metrics.update(ev.metrics)
        elif isinstance(ev, CheckpointCommitted):
            self.report(ev.step, ev.path)

    def report(self, step: int, path: str) -> None:
        from ray import tune  # noqa: PLC0415

        t0 = time.perf_counter()
        pointer = self.hand_over(step, path)
        parent = self.lineage[-1]["from"]
        metrics = {
            **self.metrics,
            "step": step,
            "segments": len(self.lineage),
            "forked_from": "" if parent is None else f"{parent['trial']}@{parent['step']}",
            "finished": step >= self.total,  # ran to its last step (ReleaseStopped keeps it)
            # Tune stops a trial whose result says done, before its scheduler sees the result:
            # PBT never exploits a finished trial into itself again and again
            "done": step >= self.total,
        }
        # beside the checkpoint: on the same file system, so that its files can be linked
        with tempfile.TemporaryDirectory(prefix=".tune-report-", dir=Path(path).parent) as d:
            tune_checkpoint(d, pointer, path, self.handover)
            fork, held = metrics["forked_from"], time.perf_counter() - t0  # Tune's copy follows
            self.emit(TrialReported(self.trial, step, os.getpid(), held, len(self.lineage), fork))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))

    def hand_over(self, step: int, path: str) -> dict[str, Any]:
        """Make the checkpoint at ``path`` readable by other trials (in the object store, owned
        by the node's keeper, unless Tune's storage carries it); returns its pointer."""
        pointer = {
            "format": FORMAT,
            "key": self.key,
            "step": step,
            "trial": self.trial,
            "uri": path if self.disk else None,
            "lineage": self.lineage,
        }
        if self.handover == "tune_storage":
            return pointer
        import ray  # noqa: PLC0415

        reg, keeper = objstore.registry(), _keeper()
        # the node's keeper reads the checkpoint from this node's shared memory and owns the
        # object: it outlives this trial, and a trial on another node reads it from here
        refs = ray.get(keeper.adopt.remote(self.key, step, path))
        if not refs:
            raise CheckpointError(f"{path}: gone before it reached the object store")
        nbytes = ray.get(keeper.lookup.remote(self.key, step))["nbytes"]
        ray.get(reg.register.remote(self.key, step, refs, pointer["uri"], nbytes, pointer))
        del refs
        self.held = [*(s for s in self.held if s != step), step]
        while len(self.held) > self.keep:
            old = self.held.pop(0)  # an earlier start of this trial may have run on another node
            ray.get([r.delete.remote(self.key, old) for r in (reg, *_keepers())])
        return pointer


def tune_checkpoint(into: str | os.PathLike, pointer: dict[str, Any], path: str, how: str) -> None:
    """Fill ``into``, the directory reported to Tune as a trial's checkpoint: the pointer, and
    for ``tune_storage`` the checkpoint's files too (hard links, no copy: Tune copies them)."""
    if how == "tune_storage":
        for f in Path(path).iterdir():
            os.link(f, Path(into, f.name))
    Path(into, POINTER).write_text(json.dumps(pointer))


def start_from(
    tune_ck: Any, stack: contextlib.ExitStack, log: Callable[[str], None]
) -> tuple[Checkpoint | None, dict[str, Any] | None, Any]:
    """The checkpoint a trial starts from, its pointer and where it is (for a distributed
    run's servers), given Tune's checkpoint: the checkpoint directory itself where Tune's
    storage carried it (kept on hand by ``stack`` for as long as the trial runs), else the
    object the pointer names."""
    if tune_ck is None:
        return None, None, None
    d = stack.enter_context(tune_ck.as_directory())
    pointer = read_pointer(d)
    if Path(d, MANIFEST).is_file():
        return Checkpoint.open(d, verify="full"), pointer, d
    return fetch_newest(pointer, log)


def run_trial(spec: TrialSpec, params: dict[str, Any]) -> None:
    """The body of one Tune trial (see :func:`trainable`)."""
    from ray import tune  # noqa: PLC0415

    say = print if spec.log else (lambda line: None)
    with contextlib.ExitStack() as stack:
        source, pointer, where = start_from(tune.get_checkpoint(), stack, say)
        _run(spec, params, tune.get_context(), (source, where), pointer, say)


def _run(
    spec: TrialSpec,
    params: dict[str, Any],
    ctx: Any,
    start: tuple[Checkpoint | None, Any],
    pointer: dict[str, Any] | None,
    say: Callable[[str], None],
) -> None:
    from raysinga.distributed.trainer import DistributedTrainer  # noqa: PLC0415
    from raysinga.run.trainer import Trainer  # noqa: PLC0415

    source, source_at = start
    trial, experiment = ctx.get_trial_id(), ctx.get_experiment_name()
    lineage = continue_lineage(pointer, trial, params)
    incarnation = f"{trial}-{uuid.uuid4().hex[:8]}"
    if spec.checkpoint_dir:
        where = f"{spec.checkpoint_dir.rstrip('/')}/{experiment}/{incarnation}"
        keep_last = spec.keep
    else:
        drop_earlier(Path(SHM_ROOT, experiment), trial)
        where, keep_last = str(Path(SHM_ROOT, experiment, incarnation)), 1
    base = config.from_dict(spec.job)
    cfg = job_for(
        spec.job,
        params,
        name=f"{base.name}-{trial}",
        run_dir=str(Path(ctx.get_trial_dir(), "raysinga")),
        checkpoint_frequency=spec.report_every,
        test_freq=spec.report_every if base.test_freq == 0 else base.test_freq,
        **{"checkpoint.dir": where, "checkpoint.keep_last": keep_last},
        **{"checkpoint.object_store": False, "checkpoint.final": True},
        # the search's scheduler stops or replaces a poor trial; a NaN still ends one
        **({} if "divergence" in spec.job else {"divergence.factor": None}),
    )
    Path(cfg.run_path).mkdir(parents=True, exist_ok=True)
    Path(cfg.run_path, "lineage.json").write_text(json.dumps(lineage, indent=1))
    key = f"tune/{experiment}/{trial}"
    reporter = Reporter(
        key,
        trial,
        lineage,
        spec.keep,
        bool(spec.checkpoint_dir),
        handover=spec.handover,
        total=cfg.train_steps,
    )
    if source is not None:  # until its own first report: the metrics of the state it took
        reporter.metrics = last_metrics(run_info(source)["history"])
    subscribers: list[Callable[[Event], None]] = [reporter]
    if spec.on_event is not None:
        observer = spec.on_event
        reporter.emit = lambda ev: observer(trial, ev)
        subscribers.insert(0, reporter.emit)
    if spec.handover == "object_store":  # what earlier starts of this trial left count too
        reporter.held = _held_steps(key)
    try:
        if cfg.topology is None:
            Trainer(cfg, log=say, on_event=subscribers, fork_from=source).fit()
        else:  # the servers read the checkpoint themselves, from the object store or a path
            run = DistributedTrainer(
                cfg, log=say, on_event=subscribers, fork_from=source_at, gather=False
            )
            # an earlier start of this trial, stopped by Tune, left its placement group
            run.placement_name = placement_name(experiment, trial)
            run.fit()
    finally:
        if not spec.checkpoint_dir:
            shutil.rmtree(where, ignore_errors=True)
