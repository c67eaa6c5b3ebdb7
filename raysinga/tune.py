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

Every trial records its lineage: the segments of steps it (and the trials it forked from) ran,
each with its hyperparameters. :func:`replay` runs a lineage again, segment by segment, and ends
bit-identical to the trial.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import config
from .checkpoint import Checkpoint, CheckpointError, objstore
from .events import CheckpointCommitted, Evaluated, Event, TrainStep
from .run_state import run_info

POINTER = "raysinga-checkpoint.json"
SHM_ROOT = "/dev/shm/raysinga-tune"
_FORMAT = 1


@dataclass(frozen=True)
class TrialSpec:
    """What every trial of a search shares: the job (as a dict, so that trials on any node
    need no job file), how often it reports, and where its checkpoints live."""

    job: dict[str, Any]
    report_every: int
    keep: int = 2
    checkpoint_dir: str | None = None
    log: bool = False


def trainable(
    job: str | os.PathLike | Mapping[str, Any],
    overrides: Sequence[str] = (),
    *,
    report_every: int | None = None,
    keep: int = 2,
    checkpoint_dir: str | None = None,
    log: bool = False,
) -> Callable[[dict[str, Any]], None]:
    """A Ray Tune function trainable running ``job`` (a job file or dict, with ``overrides``
    as ``--set`` takes them) once per trial, with the trial's ``param_space`` values applied as
    dotted job keys (``{"updater.lr": tune.loguniform(1e-4, 1e-1)}``; nested dicts work too).

    ``report_every``: steps between reports, each with an evaluation and a checkpoint (default:
    the job's ``checkpoint_frequency``, else ``test_freq``, else a tenth of the run).
    ``keep``: the newest checkpoints per trial kept in the object store. ``checkpoint_dir``: a
    path or URI where every trial also keeps a disk copy (used when an object is lost).
    ``log``: print the runs' console lines. The job is checked here, before any trial starts.
    """
    if isinstance(job, Mapping):
        cfg = config.from_dict(config.apply_overrides(dict(job), list(overrides)))
    else:
        cfg = config.load(job, list(overrides))
    every = report_every or cfg.checkpoint_frequency or cfg.test_freq or -(-cfg.train_steps // 10)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"report_every must be a positive number of steps, got {report_every!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive number of checkpoints, got {keep!r}")
    spec = TrialSpec(cfg.raw, every, keep, checkpoint_dir, log)

    def raysinga_trial(params: dict[str, Any]) -> None:
        run_trial(spec, params)

    return raysinga_trial


def flat_overrides(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Tune's ``config`` (flat dotted keys or nested dicts) as dotted job keys -> values."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and not _is_value(key, v):
            out.update(flat_overrides(v, f"{key}."))
        else:
            out[key] = v
    return out


def _is_value(key: str, v: Mapping[str, Any]) -> bool:
    """A mapping that is a job value itself (a schedule ``{kind: cosine, ...}``)."""
    return "kind" in v


def job_for(spec: TrialSpec, params: Mapping[str, Any], **run: Any) -> config.JobConfig:
    """The trial's job: the search's job with the trial's hyperparameters and ``run`` keys."""
    items = {**flat_overrides(params), **run}
    return config.from_dict(
        config.apply_overrides(spec.job, [f"{k}={json.dumps(v)}" for k, v in items.items()])
    )


# ------------------------------------------------------------------------ lineage


def segment(trial: str, params: Mapping[str, Any], start: int, parent: dict | None) -> dict:
    """One stretch of steps run under one set of hyperparameters."""
    return {"trial": trial, "params": flat_overrides(params), "start": start, "from": parent}


def continue_lineage(
    pointer: dict[str, Any] | None, trial: str, params: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The lineage of a trial starting now: a fresh one, or the lineage of the checkpoint it
    starts from with a new segment (its hyperparameters, from that trial and step), unless it is
    its own checkpoint under the same hyperparameters (a restart of the same segment)."""
    if pointer is None:
        return [segment(trial, params, 0, None)]
    step = int(pointer["step"])
    lineage = [dict(s) for s in pointer["lineage"] if s["start"] <= step]
    last = lineage[-1]
    if pointer["trial"] == trial and last["params"] == flat_overrides(params):
        return lineage
    return [*lineage, segment(trial, params, step, {"trial": pointer["trial"], "step": step})]


# ------------------------------------------------------------------------ pointers


def read_pointer(where: str | os.PathLike) -> dict[str, Any]:
    """The pointer in a Tune checkpoint directory (or the file itself)."""
    p = Path(where)
    p = p / POINTER if p.is_dir() else p
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p}: not a raysinga Tune checkpoint ({e})") from None
    if not isinstance(d, dict) or d.get("format") != _FORMAT:
        raise CheckpointError(f"{p}: not a raysinga Tune checkpoint of format {_FORMAT}")
    return d


def fetch(pointer: Mapping[str, Any], log: Callable[[str], None] = print) -> Checkpoint:
    """The checkpoint a pointer names: from the object store, or, where the object is lost,
    from its disk copy (saying so); an error naming both where neither is there."""
    return fetch_newest(pointer, log, newest=False)[0]


def fetch_newest(
    pointer: Mapping[str, Any], log: Callable[[str], None] = print, newest: bool = True
) -> tuple[Checkpoint, dict[str, Any]]:
    """As :func:`fetch`, with the pointer that was read. ``newest``: where the trial has
    released the step named (it kept training, and only its newest ``keep`` stay), its newest
    checkpoint instead, with that one's lineage: PBT copies the better trial as it is now."""
    import ray  # noqa: PLC0415
    from ray.exceptions import RayError  # noqa: PLC0415

    key, step, uri = pointer["key"], int(pointer["step"]), pointer.get("uri")
    why = "the registry has no entry for it"

    try:
        reg = objstore.registry()
        entry = ray.get(reg.lookup.remote(key, step))
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
            return objstore.get(entry["refs"][0]), used
    except RayError as e:
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"
    if uri:
        log(f"raysinga: the object-store copy of {key} step {step} is lost ({why}); reading {uri}")
        return Checkpoint.open(uri, verify="full"), dict(pointer)
    raise CheckpointError(
        f"{key} step {step}: the object-store copy is lost ({why}) and there is no disk copy "
        "(set checkpoint_dir= of raysinga.tune.trainable to keep one)"
    )


# ------------------------------------------------------------------------ one trial


@dataclass
class _Reporter:
    """Subscribes to a trial's run: at each committed checkpoint, hands it to the object store
    and reports the metrics since the last report to Tune, with a pointer to it."""

    key: str
    trial: str
    lineage: list[dict[str, Any]]
    keep: int
    disk: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    held: list[int] = field(default_factory=list)

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, TrainStep):
            self.metrics.update(loss=ev.loss, lr=ev.lr, samples_per_s=ev.samples_per_s)
        elif isinstance(ev, Evaluated):
            self.metrics.update(ev.metrics)
        elif isinstance(ev, CheckpointCommitted):
            self.report(ev.step, ev.path)

    def report(self, step: int, path: str) -> None:
        import ray  # noqa: PLC0415
        from ray import tune  # noqa: PLC0415

        reg, keeper = objstore.registry(), _keeper()
        # the node's keeper reads the checkpoint from this node's shared memory and owns the
        # object: it outlives this trial, and a trial on another node reads it from here
        refs = ray.get(keeper.adopt.remote(self.key, step, path))
        if not refs:
            raise CheckpointError(f"{path}: gone before it reached the object store")
        nbytes = ray.get(keeper.lookup.remote(self.key, step))["nbytes"]
        uri = path if self.disk else None
        pointer = {
            "format": _FORMAT,
            "key": self.key,
            "step": step,
            "trial": self.trial,
            "uri": uri,
            "lineage": self.lineage,
        }
        ray.get(reg.register.remote(self.key, step, refs, uri, nbytes, pointer))
        del refs
        self.held.append(step)
        while len(self.held) > self.keep:
            old = self.held.pop(0)
            ray.get([reg.delete.remote(self.key, old), keeper.delete.remote(self.key, old)])
        parent = self.lineage[-1]["from"]
        metrics = {
            **self.metrics,
            "step": step,
            "segments": len(self.lineage),
            "forked_from": "" if parent is None else f"{parent['trial']}@{parent['step']}",
        }
        with tempfile.TemporaryDirectory(prefix="raysinga-pointer-") as d:
            Path(d, POINTER).write_text(json.dumps(pointer))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))


def run_trial(spec: TrialSpec, params: dict[str, Any]) -> None:
    """The body of one Tune trial (see :func:`trainable`)."""
    from ray import tune  # noqa: PLC0415

    from .trainer import Trainer  # noqa: PLC0415

    ctx = tune.get_context()
    trial, experiment = ctx.get_trial_id(), ctx.get_experiment_name()
    say = print if spec.log else (lambda line: None)
    tune_ck = tune.get_checkpoint()
    pointer, source = None, None
    if tune_ck is not None:
        with tune_ck.as_directory() as d:
            source, pointer = fetch_newest(read_pointer(d), say)
    lineage = continue_lineage(pointer, trial, params)
    incarnation = f"{trial}-{uuid.uuid4().hex[:8]}"
    if spec.checkpoint_dir:
        where = f"{spec.checkpoint_dir.rstrip('/')}/{experiment}/{incarnation}"
        keep_last = spec.keep
    else:
        _drop_earlier(Path(SHM_ROOT, experiment), trial)
        where, keep_last = str(Path(SHM_ROOT, experiment, incarnation)), 1
    base = config.from_dict(spec.job)
    cfg = job_for(
        spec,
        params,
        name=f"{base.name}-{trial}",
        run_dir=str(Path(ctx.get_trial_dir(), "raysinga")),
        checkpoint_frequency=spec.report_every,
        test_freq=spec.report_every if base.test_freq == 0 else base.test_freq,
        **{"checkpoint.dir": where, "checkpoint.keep_last": keep_last},
        **{"checkpoint.object_store": False, "checkpoint.final": True},
    )
    Path(cfg.run_path).mkdir(parents=True, exist_ok=True)
    Path(cfg.run_path, "lineage.json").write_text(json.dumps(lineage, indent=1))
    key = f"tune/{experiment}/{trial}"
    reporter = _Reporter(key, trial, lineage, spec.keep, bool(spec.checkpoint_dir))
    if source is not None:  # until its own first report: the metrics of the state it took
        reporter.metrics = last_metrics(run_info(source)["history"])
    try:
        Trainer(cfg, log=say, on_event=reporter, fork_from=source).fit()
    finally:
        if not spec.checkpoint_dir:
            shutil.rmtree(where, ignore_errors=True)


KEEPER_PREFIX = "raysinga-keeper-"


def _keeper(node: str | None = None) -> Any:
    """The checkpoint keeper of this node (or ``node``): a detached actor pinned to it that puts
    the node's trial checkpoints into the object store and owns them (a registry of its own)."""
    import ray  # noqa: PLC0415
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    node = node or ray.get_runtime_context().get_node_id()
    return (
        ray.remote(objstore.CheckpointRegistry)
        .options(
            name=f"{KEEPER_PREFIX}{node}",
            namespace=objstore.REGISTRY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        )
        .remote()
    )


def _keepers() -> list[Any]:
    import ray  # noqa: PLC0415

    names = ray.util.list_named_actors(all_namespaces=True)
    return [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in names
        if a["namespace"] == objstore.REGISTRY_NAMESPACE and a["name"].startswith(KEEPER_PREFIX)
    ]


def last_metrics(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The newest training loss and learning rate and evaluation of a run's history."""
    out: dict[str, Any] = {}
    for r in history:
        if r.get("kind") == "train":
            out.update(loss=r["loss"], lr=r["lr"], samples_per_s=r["samples_per_s"])
        elif r.get("kind") == "eval":
            out.update({k: v for k, v in r.items() if k not in ("kind", "step")})
    return out


def _drop_earlier(root: Path, trial: str) -> None:
    """Remove this trial's earlier working copies on this node (a trial that Tune stopped and
    started again cannot clean up after itself)."""
    for d in root.glob(f"{trial}-*") if root.is_dir() else ():
        shutil.rmtree(d, ignore_errors=True)


def release(experiment: str, trial: str | None = None) -> int:
    """Drop the object-store checkpoints of a search (or of one of its trials) from the
    registry, and the working copies on this node; returns how many objects were dropped."""
    import ray  # noqa: PLC0415

    prefix = f"tune/{experiment}/" + (trial or "")
    gone = 0
    for i, reg in enumerate([objstore.registry(), *_keepers()]):
        for e in ray.get(reg.list.remote()):
            if e["run"].startswith(prefix) and (trial is None or e["run"] == prefix):
                dropped = bool(ray.get(reg.delete.remote(e["run"], e["step"])))
                gone += dropped and i == 0
    shm = Path(SHM_ROOT, experiment)
    if trial is None:
        shutil.rmtree(shm, ignore_errors=True)
    else:
        _drop_earlier(shm, trial)
    return gone


# ------------------------------------------------------------------------ replay


def replay(
    lineage: Sequence[Mapping[str, Any]] | str | os.PathLike,
    job: str | os.PathLike | Mapping[str, Any],
    work_dir: str | os.PathLike,
    until: int,
    overrides: Sequence[str] = (),
) -> Any:
    """Run a trial's ``lineage`` (a list of segments, or a Tune checkpoint / pointer file, whose
    lineage ends at its step) of ``job`` again in this process, each segment from the previous
    one's checkpoint under its own hyperparameters, to step ``until``. Returns the last
    segment's :class:`~raysinga.trainer.TrainResult`: bit-identical to the trial at that step.
    The checkpoints of the segments are written under ``work_dir``."""
    from .trainer import Trainer  # noqa: PLC0415

    if not isinstance(lineage, Sequence) or isinstance(lineage, str):
        lineage = read_pointer(lineage)["lineage"]
    spec = trainable_spec(job, overrides)
    base = config.from_dict(spec.job)
    source, result = None, None
    for i, seg in enumerate(lineage):
        end = lineage[i + 1]["start"] if i + 1 < len(lineage) else until
        if end <= seg["start"]:
            continue
        d = Path(work_dir, f"segment-{i}")
        cfg = job_for(spec, seg["params"], name=f"{base.name}-replay-{i}", run_dir=str(d))
        stop = None if end >= cfg.train_steps else end
        result = Trainer(cfg, log=None, fork_from=source, until=stop).fit()
        source = result.checkpoint
    if result is None:
        raise ValueError("the lineage holds no steps to run")
    return result


def trainable_spec(
    job: str | os.PathLike | Mapping[str, Any], overrides: Sequence[str] = ()
) -> TrialSpec:
    if isinstance(job, Mapping):
        cfg = config.from_dict(config.apply_overrides(dict(job), list(overrides)))
    else:
        cfg = config.load(job, list(overrides))
    return TrialSpec(cfg.raw, max(cfg.checkpoint_frequency, 1))
