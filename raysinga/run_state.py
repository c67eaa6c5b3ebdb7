"""What a training checkpoint holds, and how trainers write and read it.

A training checkpoint is an ordinary checkpoint (:mod:`raysinga.checkpoint`) whose shards are
written by the parameter servers, one each, in parallel: every slice of every parameter (kind
``param``) and of every optimizer slot (kind ``slot``, named ``<param>/<slot>``), stored under the
parameter's own name and flat element range. Any other slicing reads it back with
``flat_range`` (resharding). One more shard, written by the driver, holds the workers'
non-trainable state (kind ``state``): group 0 / worker 0's under the plain names (what evaluation
and export use) and every worker's under ``worker/g<G>w<I>/<name>``.

The manifest's ``meta["run"]`` holds everything else resume needs::

    format      RUN_FORMAT
    model       {"digest": ModelSpec.digest(), "spec": ...}
    topology    the topology that wrote it (informative: a different one reshards)
    steps       steps done per group
    data        what the cursor assumes of the data: batch size, order, sample count and
                shape, a digest of some rows (raysinga.data_identity); checked on resume
    cursor      {"batch_offset": B, "skip": [...]}: group g's batch at step s is slot
                s * n_groups + g + B of the run's data order, where slot k is the k-th batch
                index not in skip (batches consumed out of turn; see raysinga.cursor)
    rng         {"seed": S}: the seed of initialisation, data order and dropout masks; every
                random draw is a pure function of it and of step/sample counters, so the
                seed is the whole RNG state
    optimizer   {"name", "hparams", "schedule", "counts": {param: updates applied}}
    history     the metric records so far (metrics.jsonl up to this step), ending with this
                checkpoint's own record: its step (its timings are known only once committed)
    best        the best evaluation so far ({"step", "metric", "value"}) or None
    config      the job as given
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import data_identity
from .checkpoint import Checkpoint, CheckpointError, Location, placement, storage, writer
from .checkpoint.filehash import hash_file as _hash_file
from .checkpoint.finetune import MatchReport, match
from .checkpoint.format import TensorInfo
from .checkpoint.lock import RunLock
from .checkpoint.manage import latest, prune, recover, remove_staged, steps
from .cursor import DataCursor

RUN_FORMAT = 1
WORKER_PREFIX = "worker/"


def worker_key(group: int, index: int, name: str) -> str:
    return f"{WORKER_PREFIX}g{group}w{index}/{name}"


class Preempted(Exception):
    """Training stopped on a signal (SIGTERM, Ctrl-C) after checkpointing, so that it resumes."""

    def __init__(self, signum: int, step: int, saved: list[dict[str, Any]]) -> None:
        import signal  # noqa: PLC0415

        self.signum, self.step = signum, step
        self.path = saved[-1]["path"] if saved and saved[-1]["step"] == step else None
        where = f"checkpoint {self.path}" if self.path else "no checkpoint (checkpoint.final off)"
        super().__init__(
            f"stopped by {signal.Signals(signum).name} at step {step}; {where}; "
            "continue with --resume"
        )


# --------------------------------------------------------------------------- writing


def slice_tensors(
    slices: list[Any],
    shapes: dict[str, tuple[int, ...]],
    values: dict[str, np.ndarray],
    slots: dict[str, dict[str, np.ndarray]],
    version: int,
) -> list[tuple[TensorInfo, np.ndarray]]:
    """A server's shard: its parameter slices, then their optimizer slots.

    ``values`` and ``slots`` are keyed by slice name (``Slice.name``); slots of a slice that
    has not been updated yet may be absent.
    """
    out = []
    for s in slices:
        shape, arr = tuple(shapes[s.param]), values[s.name]
        out.append(
            (TensorInfo(s.param, "param", shape, str(arr.dtype), s.start, s.stop, version), arr)
        )
    for s in slices:
        for slot, arr in sorted(slots.get(s.name, {}).items()):
            info = TensorInfo(
                f"{s.param}/{slot}",
                "slot",
                tuple(shapes[s.param]),
                str(arr.dtype),
                s.start,
                s.stop,
                version,
            )
            out.append((info, arr))
    return out


def state_tensors(
    states: dict[tuple[int, int], dict[str, np.ndarray]],
) -> list[tuple[TensorInfo, np.ndarray]]:
    """The driver's shard: non-trainable state of every worker (keyed by (group, index))."""
    out = []
    first = states.get((0, 0), {})
    named = [(n, a) for n, a in first.items()]
    named += [
        (worker_key(g, i, n), a) for (g, i), st in sorted(states.items()) for n, a in st.items()
    ]
    for name, a in named:
        a = np.ascontiguousarray(a)
        out.append((TensorInfo(name, "state", a.shape, str(a.dtype), 0, a.size), a))
    return out


def merge_optimizer(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The servers' optimizer descriptions as one: update counts by parameter."""
    counts: dict[str, int] = {}
    for p in parts:
        for param, c in p["counts"].items():
            if counts.setdefault(param, c) != c:
                raise CheckpointError(
                    f"optimizer: slices of {param!r} disagree on the update count "
                    f"({counts[param]} vs {c})"
                )
    first = parts[0]
    return {
        "name": first["name"],
        "hparams": first["hparams"],
        "schedule": first["schedule"],
        "counts": dict(sorted(counts.items())),
    }


def run_meta(
    cfg: Any,
    steps: list[int],
    cursor: DataCursor,
    optimizer: dict[str, Any],
    history: list[dict[str, Any]],
    step: int,
    seed: int | None = None,
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest meta of the training checkpoint of ``step`` (see the module's docstring)."""
    topo = cfg.topology.to_dict() if cfg.topology is not None else None
    history = [*history, {"kind": "checkpoint", "step": step}]
    return {
        "run": {
            "format": RUN_FORMAT,
            "name": cfg.name,
            "model": {"digest": cfg.model.digest(), "spec": cfg.model.to_dict()},
            "topology": topo,
            "steps": list(steps),
            "cursor": cursor.to_dict(),
            "rng": {"seed": cfg.seed if seed is None else seed},
            "optimizer": optimizer,
            "data": data,
            "history": history,
            "best": best_eval(history),
            "config": cfg.raw,
        }
    }


def best_eval(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best evaluation: highest test accuracy where there is one, else lowest test loss."""
    evals = [r for r in history if r.get("kind") == "eval"]
    if not evals:
        return None
    if all("test_accuracy" in r for r in evals):
        r = max(evals, key=lambda r: (r["test_accuracy"], -r["step"]))
        return {"step": r["step"], "metric": "test_accuracy", "value": r["test_accuracy"]}
    r = min(evals, key=lambda r: (r["test_loss"], r["step"]))
    return {"step": r["step"], "metric": "test_loss", "value": r["test_loss"]}


# --------------------------------------------------------------------------- reading


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
            from .checkpoint import objstore  # noqa: PLC0415 - needs Ray

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
            if _hash_file(self.location.join(name)) != sums[name]:
                raise CheckpointError(
                    f"{self.location.join(name)}: checksum mismatch: the file is corrupt"
                )


def run_info(ck: Checkpoint) -> dict[str, Any]:
    """``meta["run"]`` of a training checkpoint, checked for the keys resume relies on."""
    run = ck.meta.get("run") if isinstance(ck.meta, dict) else None
    keys = ("format", "model", "steps", "cursor", "rng", "optimizer", "history")
    if not isinstance(run, dict) or any(k not in run for k in keys):
        raise CheckpointError(
            f"{ck.location}: a checkpoint, but not of a training run (no run state in its "
            "manifest); use --init-from to load its parameters into a new run"
        )
    if not isinstance(run["format"], int) or run["format"] > RUN_FORMAT:
        raise CheckpointError(
            f"{ck.location}: run state format {run['format']!r} is newer than this raysinga "
            f"({RUN_FORMAT}); upgrade to resume it"
        )
    return run


def check_fits(
    ck: Checkpoint, shapes: dict[str, tuple[int, ...]], dtype: Any = None
) -> MatchReport:
    """Resume needs every parameter by name and shape, and (given ``dtype``) its values and
    optimizer slots in that dtype: anything else is refused with the list."""
    if dtype is not None:
        want = np.dtype(dtype).name
        wrong = [
            f"{n} ({ck.info(n).dtype})"
            for n in ck.names("param") + ck.names("slot")
            if ck.info(n).dtype != want
        ]
        if wrong:
            raise CheckpointError(
                f"{ck.location}: the run trains in {want} but the checkpoint holds "
                f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}; resume with the "
                "checkpoint's dtype, or start a new run from it with --init-from (which casts)"
            )
    stored = {n: ck.info(n).shape for n in ck.names("param")}
    report = MatchReport()
    for n, shape in stored.items():
        if n not in shapes:
            report.unexpected.append(n)
        elif tuple(shape) != tuple(shapes[n]):
            report.mismatched.append((n, tuple(shape), tuple(shapes[n])))
        else:
            report.matched.append(n)
    report.missing = [n for n in shapes if n not in stored]
    if not report.perfect:
        raise CheckpointError(
            f"{ck.location}: the checkpoint does not fit this model (to start a new run from "
            f"what matches, use --init-from instead of --resume):\n{report}"
        )
    return report


def slot_names(ck: Checkpoint, param: str) -> list[str]:
    pre = param + "/"
    return sorted(
        n[len(pre) :] for n in ck.names("slot") if n.startswith(pre) and "/" not in n[len(pre) :]
    )


def worker_state(ck: Checkpoint, group: int, index: int, names: list[str]) -> dict[str, np.ndarray]:
    """A worker's saved non-trainable state: its own if this checkpoint has it (same topology),
    else group 0 / worker 0's (a different topology)."""
    have = set(ck.names("state"))
    out = {}
    for n in names:
        own = worker_key(group, index, n)
        if own in have:
            out[n] = ck.array(own)
        elif n in have:
            out[n] = ck.array(n)
    return out


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
            entry = _registry_entry(registry_key(run, root))
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


def registry_key(run: str, root: str | Location) -> str:
    """How the object-store registry names a training run's checkpoints: by run name and
    checkpoint directory (two runs of one name in two directories are two runs)."""
    return f"{run}@{storage.resolve(root)}"


def _registry(create: bool = False) -> Any:
    from .checkpoint import objstore  # noqa: PLC0415

    try:
        return objstore.registry(create=create)
    except ValueError:  # no registry yet
        return None


def _registry_entry(key: str) -> dict[str, Any] | None:
    import ray  # noqa: PLC0415

    reg = _registry()
    entry = None if reg is None else ray.get(reg.lookup.remote(key))
    if entry is None:
        return None
    ready, _ = ray.wait(entry["refs"], timeout=0, fetch_local=False)
    return entry if ready else None


def _forget_registry(key: str) -> None:
    """Drop the registry's object-store copies of a run (it starts over)."""
    import ray  # noqa: PLC0415

    reg = _registry()
    for e in [] if reg is None else ray.get(reg.list.remote(key)):
        ray.get(reg.delete.remote(key, e["step"]))


def keep_in_object_store(
    key: str, step: int, uri: str, deleted: list[int], adopting: list[Any]
) -> None:
    """``checkpoint.object_store``: the registry (a detached actor, which then owns the object)
    puts the checkpoint just committed at ``uri`` into Ray's object store under ``key``
    (:func:`registry_key`), and drops the steps pruned from the directory, so that the store
    holds what the directory holds. The call is not waited for; its ref joins ``adopting``
    (those still running), for :func:`wait_adopted` at the end of the run."""
    import ray  # noqa: PLC0415

    reg = _registry(create=True)
    if adopting:
        _, adopting[:] = ray.wait(adopting, num_returns=len(adopting), timeout=0)
    adopting.append(reg.adopt.remote(key, step, uri))
    for s in deleted:
        reg.delete.remote(key, s)


def wait_adopted(adopting: list[Any], log: Any, timeout: float = 30.0) -> None:
    """Wait for the registry to hold the checkpoints handed to it: a driver that exits first can
    take its queued calls with it (a short run whose registry was still starting), leaving the
    object store without them. A copy that did not arrive is reported, not raised: the
    checkpoints on disk are committed all the same."""
    if not adopting:
        return
    import ray  # noqa: PLC0415

    try:
        ready, left = ray.wait(adopting, num_returns=len(adopting), timeout=timeout)
        problems = [f"not confirmed within {timeout:g} s"] if left else []
    except Exception as e:  # noqa: BLE001 - Ray gone (an interrupted run): not this run's error
        ready, problems = [], [repr(e)]
    adopting.clear()
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - any failure: the disk copy stands
            problems.append(str(e).strip().splitlines()[-1])
    if problems:
        log(
            "raysinga: the object store may lack a checkpoint's copy "
            f"({'; '.join(problems)}); the directory holds it"
        )


def plan_verification(files: list[str], readers: int) -> list[list[str]]:
    """Share the full hashing of a checkpoint's files among ``readers``."""
    out: list[list[str]] = [[] for _ in range(max(readers, 1))]
    for i, f in enumerate(files):
        out[i % len(out)].append(f)
    return out


__all__ = [
    "RUN_FORMAT",
    "Preempted",
    "Source",
    "best_eval",
    "check_fits",
    "find_resume",
    "open_init",
    "merge_optimizer",
    "plan_verification",
    "run_info",
    "run_meta",
    "slice_tensors",
    "slot_names",
    "set_aside",
    "state_tensors",
    "verify_start",
    "worker_state",
]


# --------------------------------------------------------------------------- starting a run


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
    if not resume:
        if have:
            raise CheckpointError(
                f"{root} already holds checkpoints of run {cfg.name!r} (newest: step "
                f"{have[0]}); pass --resume to continue it, --fresh to delete them and start "
                "over, or give the run another name or checkpoint.dir"
            )
        if cfg.checkpoint.object_store:  # copies of an earlier run here are not this run's
            _forget_registry(registry_key(cfg.name, root))
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
    # clip_norm is applied by the stubs from the job file, like train_steps
    keys = sorted(
        k for k in set(saved) | set(now) if k != "clip_norm" and saved.get(k) != now.get(k)
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


def set_aside(root: Location, name: str) -> str:
    """Move the committed checkpoint directory ``name`` that failed validation out of the way,
    to ``<name>.invalid-<id>`` beside it: kept for a look, ignored by readers, and out of the
    way of the resumed run, which writes that step again (without ``replace``, a checkpoint is
    never overwritten). On object stores the move is a copy of every object, then a delete
    (placement.move_dir)."""
    import uuid  # noqa: PLC0415

    src, dst = root.join(name), root.join(f"{name}.invalid-{uuid.uuid4().hex[:8]}")
    try:
        placement.move_dir(src, dst)
    except Exception as e:  # pyarrow raises OSError, or NotImplementedError on some stores
        raise CheckpointError(
            f"{src}: failed validation and could not be moved aside ({e}); move or delete it, "
            "then resume again"
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
    where: Any, shapes: dict[str, tuple[int, ...]], log: Any
) -> tuple[Source, Checkpoint, list[str]]:
    """``--init-from``: the checkpoint (size checks only: the caller verifies its files) and the
    names of its parameters that fit this model by name and shape; an error when none does."""
    src = init_source(where)
    ck = src.open(verify="fast")
    stored = {n: _Shape(ck.info(n).shape) for n in ck.names("param")}
    _, report = match(stored, shapes)  # type: ignore[arg-type]
    log(f"raysinga: --init-from {src.label} (step {ck.step}): {report}")
    if not report.matched:
        raise CheckpointError(f"--init-from {src.label}: no parameter of it fits this model")
    return src, ck, list(report.matched)


@dataclass
class _Shape:
    """What name matching reads of a stored array, without reading the array."""

    shape: tuple[int, ...]


def cursor_for(info: dict[str, Any], n_groups: int) -> tuple[list[int], DataCursor]:
    """Steps per group and the data cursor for ``n_groups`` groups, from a checkpoint's run
    state: the same groups continue where they were; a different number of groups starts at
    the slowest one's step, skipping the batches the faster ones took (:mod:`.cursor`)."""
    saved = [int(s) for s in info["steps"]]
    try:
        cursor = DataCursor.from_dict(info["cursor"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"run state: malformed data cursor {info['cursor']!r}: {e}") from e
    return cursor.regroup(saved, n_groups)


def init_source(where: Any) -> Source:
    """A checkpoint to start from: a path or URI, a Checkpoint, or an object-store ref."""
    if isinstance(where, Checkpoint):
        return Source(checkpoint=where, label=str(where.location))
    if isinstance(where, (str, Location)) or hasattr(where, "__fspath__"):
        loc = storage.resolve(where)
        return Source(location=loc, label=str(loc))
    return Source(refs=[where], label="object store")


class LocalCheckpoints:
    """Checkpoints of the single-process trainer, in the layout of a one-server run (so either
    trainer resumes the other's), written in this process at step boundaries."""

    def __init__(self, trainer: Any) -> None:
        self.t, cfg = trainer, trainer.cfg
        self.root = storage.resolve(cfg.checkpoint_dir)
        self.seed, self.start, self.cursor = cfg.seed, 0, DataCursor()
        self.data = data_identity.identity(
            trainer.train_data, cfg.data.batch_size, cfg.data.shuffle
        )
        self.history: list[dict[str, Any]] = []
        self.metrics: Any = None  # the trainer's MetricsLog while its loop runs
        self.adopting: list[Any] = []  # the object-store registry's calls still running
        self.params = trainer.net.init_params(cfg.seed)
        self.state = trainer.net.init_state()
        self.stop_signal: int | None = None
        self.saved_at: dict[int, tuple[int, ...]] = {}  # step -> the groups' steps saved there
        self.saved: list[dict[str, Any]] = []
        self.lock: RunLock | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> LocalCheckpoints:
        if self.t.cfg.checkpoint.object_store:  # the registry is a Ray actor
            from .actors import cluster  # noqa: PLC0415

            cluster.connect()
        self.lock = RunLock(self.root).acquire()
        try:
            self._open()
        except BaseException:
            self.lock.release()
            raise
        if threading.current_thread() is threading.main_thread() and not _in_ray_worker():
            self._old = {
                s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)
            }
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        try:
            wait_adopted(self.adopting, self.t.log)
        finally:
            if self.lock is not None:
                self.lock.release()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_signal is not None:
            for s, h in self._old.items():
                signal.signal(s, h)
            raise KeyboardInterrupt
        self.stop_signal = signum
        self.t.log(f"raysinga: {signal.Signals(signum).name}: stopping after this step")

    def _open(self) -> None:
        t, cfg = self.t, self.t.cfg
        shapes = t.net.param_shapes()
        src, ck = open_run(self.root, cfg, t.resume, t.fresh, t.log)
        if src is not None and ck is not None:
            src, ck = verify_start(self.root, cfg, src, ck, _verify_all, t.log)
            info = run_info(ck)
            check_fits(ck, shapes, t.net.dtype)
            data_identity.check_resume(ck, info, self.data)
            self.params = {p: np.array(ck.array(p)) for p in shapes}
            self._load_state(ck)
            opt = info["optimizer"]
            t.optimizer.load_state_dict(
                {
                    "name": opt["name"],
                    "hparams": opt["hparams"],
                    "schedule": opt["schedule"],
                    "slots": {
                        f"{p}/{s}": ck.array(f"{p}/{s}") for p in shapes for s in slot_names(ck, p)
                    },
                    "counts": {p: int(opt["counts"].get(p, 0)) for p in shapes},
                }
            )
            (self.start,), self.cursor = cursor_for(info, 1)
            self.seed = int(info["rng"]["seed"])
            self.history = [r for r in info["history"] if r.get("step", 0) <= self.start]
            self.saved_at[ck.step] = tuple(int(s) for s in info["steps"])
            t.log(f"raysinga: resuming {cfg.name!r} at step {self.start} from {src.label}")
        elif t.init_from is not None:
            src, ck, names = open_init(t.init_from, shapes, t.log)
            _verify_all(src, ck)
            for p in names:
                self.params[p] = np.array(ck.array(p), dtype=t.net.dtype)
            self._load_state(ck)

    def _load_state(self, ck: Checkpoint) -> None:
        """Group 0 / worker 0's saved non-trainable state, as writable copies."""
        saved = worker_state(ck, 0, 0, list(self.state))
        self.state.update({k: np.array(v) for k, v in saved.items()})

    def due(self, step: int) -> bool:
        return self.t.cfg.checkpoint_due(step)

    def save(
        self, step: int, params: dict, state: dict, history: list, final: bool = False
    ) -> None:
        from .kernels import to_numpy  # noqa: PLC0415
        from .trainer import check_finite_state  # noqa: PLC0415 - trainer imports this module

        cfg = self.t.cfg
        if (final and not cfg.checkpoint.final) or self.saved_at.get(step) == (step,) or step == 0:
            return
        # A Downpour checkpoint resumed here may hold other groups' steps under this number.
        replace = step in self.saved_at
        t0 = time.perf_counter()
        shapes = self.t.net.param_shapes()
        slices = [_WholeSlice(p, int(np.prod(s))) for p, s in shapes.items()]
        st = self.t.optimizer.state_dict()
        slice_of = {s.param: s.name for s in slices}
        slots: dict[str, dict[str, np.ndarray]] = {}
        for key, arr in st["slots"].items():
            p, _, slot = key.rpartition("/")
            slots.setdefault(slice_of[p], {})[slot] = to_numpy(arr).reshape(-1)
        values = {s.name: to_numpy(params[s.param]).reshape(-1) for s in slices}
        check_finite_state(
            [
                *((s.param, values[s.name]) for s in slices),
                *((k, to_numpy(v)) for k, v in st["slots"].items()),
            ],
            step,
        )
        tmp = writer.begin(self.root, step, replace=replace)
        try:
            shard = writer.write_shard(
                tmp,
                0,
                slice_tensors(slices, shapes, values, slots, step),
                cfg.checkpoint.compression,
            )
            st_shard = writer.write_shard(
                tmp,
                1,
                state_tensors({(0, 0): {k: to_numpy(v) for k, v in state.items()}}),
                cfg.checkpoint.compression,
            )
            opt = {
                "name": st["name"],
                "hparams": st["hparams"],
                "schedule": st["schedule"],
                "counts": {p: int(st["counts"].get(p, 0)) for p in shapes},
            }
            meta = run_meta(
                cfg, [step], self.cursor, opt, history, step, seed=self.seed, data=self.data
            )
            path = writer.commit(tmp, step, [shard, st_shard], meta, replace=replace)
        except BaseException:
            storage.remove_dir(tmp)
            raise
        seconds = time.perf_counter() - t0
        self.saved_at[step] = (step,)
        self.saved.append({"step": step, "path": str(path), "seconds": seconds})
        self.t.log(f"raysinga: checkpoint step {step} -> {path} (written in {seconds:.2f} s)")
        if self.metrics is not None:  # training waits for the whole write in this process
            self.metrics.record(
                {
                    "kind": "checkpoint",
                    "step": step,
                    "blocked_ms": round(seconds * 1e3, 3),
                    "seconds": round(seconds, 3),
                }
            )
        deleted = prune(
            self.root,
            cfg.checkpoint.keep_last,
            cfg.checkpoint.keep_every,
            lock=False,
            known_valid=step,
        )
        if cfg.checkpoint.object_store:
            keep_in_object_store(
                registry_key(cfg.name, self.root), step, str(path), deleted, self.adopting
            )

    def preempted(self, step: int) -> None:
        raise Preempted(self.stop_signal or signal.SIGTERM, step, self.saved)


def _verify_all(src: Source, ck: Checkpoint) -> None:
    src.verify_files(ck, [f["file"] for f in ck.manifest["files"]])


def _in_ray_worker() -> bool:
    """Inside a Ray task or actor, where signals are Ray's to handle."""
    import sys  # noqa: PLC0415

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    return ray.get_runtime_context().worker.mode == ray.WORKER_MODE


@dataclass(frozen=True)
class _WholeSlice:
    param: str
    size: int
    start: int = 0
    server: int = 0

    @property
    def stop(self) -> int:
        return self.size

    @property
    def name(self) -> str:
        return f"{self.param}[0:{self.size}]"
