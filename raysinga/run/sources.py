"""Where a run starts from: the newest valid checkpoint of the run (on disk or in the object
store), a checkpoint given with ``--init-from``, or nothing; and what happens to checkpoints that
fail validation on the way (set aside, never deleted)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raysinga.checkpoint import Checkpoint, CheckpointError, Location, placement, storage
from raysinga.checkpoint.filehash import hash_file
from raysinga.checkpoint.finetune import MatchReport, map_name, match
from raysinga.checkpoint.format import STEP_DIR
from raysinga.checkpoint.manage import latest, recover, remove_staged, steps

from . import registry as run_registry
from .state import run_info


@dataclass
class Source:
    """Where a checkpoint to resume or start from lives: a directory or an object-store ref."""

    location: Location | None = None
    refs: list[Any] | None = None
    label: str = ""
    checkpoint: Checkpoint | None = None  # already open (in this process only)

    def open(self, verify: str = "fast") -> Checkpoint:
        if self.checkpoint is not None:
            return self.checkpoint
        if self.refs is not None:
            from raysinga.checkpoint import objstore  # noqa: PLC0415 - needs Ray

            return objstore.get(self.refs[0], verify=verify)
        assert self.location is not None
        return Checkpoint.open(self.location, verify=verify)

    def verify_files(self, ck: Checkpoint, files: list[str]) -> None:
        """Hash the given files of a disk checkpoint against its manifest (each reader checks
        its share, so a large checkpoint is verified by all of them side by side)."""
        if self.location is None or self.checkpoint is not None:
            return  # an object-store copy: verified when it was made, and held in memory
        sums = {f["file"]: f["xxh3"] for f in ck.manifest["files"]}
        for name in files:
            if hash_file(self.location.join(name)) != sums[name]:
                raise CheckpointError(
                    f"{self.location.join(name)}: checksum mismatch: the file is corrupt"
                )


def find_resume(
    root: str | Location, run: str, use_registry: bool
) -> tuple[Source | None, Checkpoint | None, list]:
    """The newest valid checkpoint of a run: from the object store when its registry has one at
    least as new as the newest on disk, else from disk. Returns (source, the checkpoint opened
    with size checks, skipped) where skipped lists newer directories that failed validation,
    with the reason."""
    found = latest(root, verify="fast")
    disk = found.checkpoint
    if use_registry:
        from ray.exceptions import RayError  # noqa: PLC0415

        try:
            entry = run_registry.lookup(run_registry.key(run, root))
            if entry is not None and (disk is None or entry["step"] >= disk.step):
                src = Source(
                    refs=entry["refs"], label=f"object store, run {run!r} step {entry['step']}"
                )
                return src, src.open(verify="fast"), found.skipped
        except RayError:  # the registry or the object was on a lost node: the disk's copy
            pass
    if disk is None:
        return None, None, found.skipped
    return Source(location=disk.location, label=str(disk.location)), disk, found.skipped


def plan_verification(files: list[str], readers: int) -> list[list[str]]:
    """Share the full hashing of a checkpoint's files among ``readers``."""
    out: list[list[str]] = [[] for _ in range(max(readers, 1))]
    for i, f in enumerate(files):
        out[i % len(out)].append(f)
    return out


def open_run(
    root: Location,
    cfg: Any,
    resume: bool | str,
    fresh: bool,
    log: Any,
) -> tuple[Source | None, Checkpoint | None]:
    """Decide what a run starts from (the caller holds the run's lock): the newest valid
    checkpoint when resuming, nothing otherwise. A fresh start over existing checkpoints is
    refused unless ``fresh``, which deletes them. First, a replace of a checkpoint cut short
    by a crash is finished or undone (only the lock holder may)."""
    for done in recover(root):
        log(f"raysinga: {done}")
    have = steps(root)
    if fresh and have:
        remove_staged(root)  # while their steps stand: a staged one alone would be restored
        for s in have:
            storage.remove_dir(root.join(f"step-{s}"))
        log(f"raysinga: --fresh: deleted {len(have)} checkpoint(s) in {root}")
        have = []
    if resume not in (False, True, "auto"):  # a chosen checkpoint of the run
        return _resume_chosen(root, cfg, str(resume), log)
    if not resume:
        if have:
            raise CheckpointError(
                f"{root} already holds checkpoints of run {cfg.name!r} (newest: step "
                f"{have[0]}); pass --resume to continue it, --fresh to delete them and start "
                "over, or give the run another name or checkpoint.dir"
            )
        if cfg.checkpoint.object_store:  # copies of an earlier run here are not this run's
            run_registry.forget(run_registry.key(cfg.name, root))
        return None, None
    src, ck, skipped = find_resume(root, cfg.name, cfg.checkpoint.object_store)
    _set_aside_skipped(root, skipped, log)
    if src is None:
        where = f"{root}" + (" or in the object store" if cfg.checkpoint.object_store else "")
        if resume == "auto":
            log(f"raysinga: no checkpoint of {cfg.name!r} in {where}: starting")
            return None, None
        raise CheckpointError(
            f"--resume: no valid checkpoint of run {cfg.name!r} in {where}"
            + (f" ({len(skipped)} invalid one(s) skipped)" if skipped else "")
            + "; run without --resume to start fresh"
        )
    _describe(ck, cfg, log)
    return src, ck


def _resume_chosen(root: Location, cfg: Any, where: str, log: Any) -> tuple[Source, Checkpoint]:
    """``--resume PATH``: go on from a chosen checkpoint of this run. Its newer checkpoints
    are moved aside (``step-N.abandoned-<id>``), so that the run, and any later resume, goes
    on from the chosen one only; an object-store copy of the run is forgotten."""
    name = where.rstrip("/").rsplit("/", 1)[-1]
    m = STEP_DIR.match(name)
    if m is None or storage.resolve(where).path.rstrip("/") != root.join(name).path.rstrip("/"):
        raise CheckpointError(
            f"--resume {where}: not a checkpoint of run {cfg.name!r}, whose checkpoints are "
            f"the step-N directories in {root}; to start a new run from it, use --init-from"
        )
    chosen = int(m.group(1))
    if chosen not in steps(root):
        raise CheckpointError(
            f"--resume {where}: no such checkpoint (steps in {root}: "
            f"{', '.join(map(str, steps(root))) or 'none'})"
        )
    ck = Checkpoint.open(root.join(name), verify="fast")
    for s in steps(root):
        if s > chosen:
            moved = set_aside(root, f"step-{s}", "abandoned")
            log(f"raysinga: --resume step-{chosen}: the newer step-{s} moved aside to {moved}")
    if cfg.checkpoint.object_store:
        run_registry.forget(run_registry.key(cfg.name, root))
    _describe(ck, cfg, log)
    return Source(location=ck.location, label=str(ck.location)), ck


def _describe(ck: Checkpoint, cfg: Any, log: Any) -> None:
    """Refuse a resume past the job's end; say what comes from the checkpoint and what from the
    job file where the two differ."""
    info = run_info(ck)
    done = max(int(s) for s in info["steps"])
    if done > cfg.train_steps:
        raise CheckpointError(
            f"{ck.location}: the checkpoint is at step {done}, beyond train_steps "
            f"{cfg.train_steps}: raise train_steps to go on, or start a new run from it with "
            "--init-from"
        )
    saved = (info.get("config") or {}).get("updater") or {}
    now = (cfg.raw or {}).get("updater") or {}
    # clip_norm and async_lr apply from the job file, like train_steps
    around = ("clip_norm", "async_lr")
    keys = sorted(
        k for k in set(saved) | set(now) if k not in around and saved.get(k) != now.get(k)
    )
    if saved and now and keys:
        log(
            f"raysinga: updater.{', updater.'.join(keys)} changed since the checkpoint: the run "
            "goes on with the checkpoint's optimizer (schedule, hyperparameters, state); the "
            "job file's train_steps, evaluation, checkpointing and topology apply"
        )
    if info["model"]["digest"] != cfg.model.digest():
        log("raysinga: the model spec changed since the checkpoint (its parameters still fit)")
    if info["rng"]["seed"] != cfg.seed:
        log(
            f"raysinga: resuming with the checkpoint's seed {info['rng']['seed']} "
            f"(the job file says {cfg.seed})"
        )


def verify_start(
    root: Location, cfg: Any, src: Source, ck: Checkpoint, verify: Any, log: Any
) -> tuple[Source, Checkpoint]:
    """Hash the checkpoint a resume starts from in full (``verify(src, ck)`` raises
    CheckpointError on a mismatch). One found corrupt is moved aside and the next older valid
    one is tried, so that a run survives a checkpoint damaged at rest. Object-store copies were
    checked when they were made and are held in memory: they are taken as they are."""
    while src.location is not None and src.checkpoint is None:
        try:
            verify(src, ck)
            return src, ck
        except CheckpointError as e:
            moved = set_aside(root, ck.location.path.rstrip("/").rsplit("/", 1)[-1])
            log(f"raysinga: {src.label} failed verification ({e}); moved aside to {moved}")
            src, ck, skipped = find_resume(root, cfg.name, use_registry=False)
            _set_aside_skipped(root, skipped, log)
            if src is None or ck is None:
                raise CheckpointError(
                    f"--resume: no checkpoint of run {cfg.name!r} in {root} passed "
                    "verification (the corrupt ones were moved aside); run without --resume "
                    "to start fresh"
                ) from e
            _describe(ck, cfg, log)
    return src, ck


def set_aside(root: Location, name: str, why: str = "invalid") -> str:
    """Move the committed checkpoint directory ``name`` (one that failed validation, or one
    newer than the checkpoint a ``--resume PATH`` goes on from) out of the way, to
    ``<name>.<why>-<id>`` beside it: kept for a look, ignored by readers, and out of the way of
    the resumed run, which writes that step again (without ``replace``, a checkpoint is never
    overwritten). On object stores the move is a copy of every object, then a delete
    (placement.move_dir)."""
    import uuid  # noqa: PLC0415

    src, dst = root.join(name), root.join(f"{name}.{why}-{uuid.uuid4().hex[:8]}")
    try:
        placement.move_dir(src, dst)
    except Exception as e:  # pyarrow raises OSError, or NotImplementedError on some stores
        raise CheckpointError(
            f"{src}: could not be moved aside ({e}); move or delete it, then resume again"
        ) from e
    return str(dst)


def _set_aside_skipped(root: Location, skipped: list, log: Any) -> None:
    """Checkpoints newer than the one resumed from that failed validation: set aside. On an
    object store one without a manifest is an interrupted in-place write, garbage: removed."""
    for where, why in skipped:
        name = where.rstrip("/").rsplit("/", 1)[-1]
        if not root.local and storage.remove_unfinished(root.join(name)):
            log(f"raysinga: skipping {where}: {why}; removed (a write cut short)")
            continue
        moved = set_aside(root, name)
        log(f"raysinga: skipping {where}: {why}; moved aside to {moved}")


def open_init(
    where: Any,
    shapes: dict[str, tuple[int, ...]],
    log: Any,
    rename: dict[str, str] | None = None,
    strip_prefix: str | None = None,
) -> tuple[Source, Checkpoint, dict[str, str], MatchReport]:
    """``--init-from``: the checkpoint (size checks only: the caller verifies its files) and its
    parameters that fit this model by name (after ``strip_prefix`` and ``rename``, as
    :func:`~raysinga.checkpoint.match`) and shape, as model name -> checkpoint name; an error
    when none does."""
    src = init_source(where)
    ck = src.open(verify="fast")
    stored = {n: _Shape(ck.info(n).shape) for n in ck.names("param")}
    _, report = match(stored, shapes, rename, strip_prefix)  # type: ignore[arg-type]
    log(f"raysinga: --init-from {src.label} (step {ck.step}): {report}")
    if not report.matched:
        raise CheckpointError(f"--init-from {src.label}: no parameter of it fits this model")
    source_of = {map_name(n, rename, strip_prefix): n for n in stored}
    return src, ck, {t: source_of[t] for t in report.matched}, report


@dataclass
class _Shape:
    """What name matching reads of a stored array, without reading the array."""

    shape: tuple[int, ...]


def init_source(where: Any) -> Source:
    """A checkpoint to start from: a path or URI, a Checkpoint, or an object-store ref."""
    if isinstance(where, Checkpoint):
        return Source(checkpoint=where, label=str(where.location))
    if isinstance(where, (str, Location)) or hasattr(where, "__fspath__"):
        loc = storage.resolve(where)
        return Source(location=loc, label=str(loc))
    return Source(refs=[where], label="object store")


def verify_all(src: Source, ck: Checkpoint) -> None:
    src.verify_files(ck, [f["file"] for f in ck.manifest["files"]])
