"""Run directories of checkpoints: save in one call, find the newest valid one, prune, and
recover from a replace cut short."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import storage, writer
from .format import MANIFEST, STEP_DIR, CheckpointError, TensorInfo
from .lock import RunLock
from .placement import commit_dir, move_dir
from .reader import Checkpoint
from .storage import Location


def tensors_of(arrays: dict[str, Any], kind: str = "param") -> list[tuple[TensorInfo, Any]]:
    """Whole tensors as (info, array) pairs for one shard."""
    out = []
    for name, a in arrays.items():
        shape = tuple(getattr(a, "shape", ()))
        size = 1
        for d in shape:
            size *= d
        out.append((TensorInfo(name, kind, shape, str(getattr(a, "dtype", "")), 0, size), a))
    return out


def save(
    root: str | Location,
    step: int,
    params: dict[str, Any],
    slots: dict[str, Any] | None = None,
    state: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    compression: str | None = None,
    lock: bool = True,
    replace: bool = False,
) -> Location:
    """Save whole tensors as a one-shard checkpoint ``<root>/step-<step>`` (single process);
    ``replace``: over a committed one of that step (see :func:`writer.commit`)."""
    root = storage.resolve(root)
    run_lock = RunLock(root) if lock else None
    if run_lock:
        run_lock.acquire()
    try:
        tmp = writer.begin(root, step, replace=replace)
        try:
            pairs = (
                tensors_of(params, "param")
                + tensors_of(slots or {}, "slot")
                + tensors_of(state or {}, "state")
            )
            shard = writer.write_shard(tmp, 0, pairs, compression)
            return writer.commit(tmp, step, [shard], meta, replace=replace)
        except BaseException:
            storage.remove_dir(tmp)
            raise
    finally:
        if run_lock:
            run_lock.release()


@dataclass
class Latest:
    checkpoint: Checkpoint | None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (directory, why)


def steps(root: str | Location) -> list[int]:
    """Steps of the committed checkpoint directories under ``root``, newest first."""
    root = storage.resolve(root)
    found = [int(m.group(1)) for d in storage.list_dirs(root) if (m := STEP_DIR.match(d))]
    return sorted(found, reverse=True)


def latest(root: str | Location, verify: str = "full") -> Latest:
    """The newest checkpoint that validates, and the newer ones skipped with the reason."""
    root = storage.resolve(root)
    out = Latest(None)
    for step in steps(root):
        loc = root.join(f"step-{step}")
        try:
            out.checkpoint = Checkpoint.open(loc, verify=verify)
            return out
        except CheckpointError as e:
            out.skipped.append((str(loc), str(e)))
    return out


def prune(
    root: str | Location,
    keep_last: int,
    keep_every: int | None = None,
    lock: bool = True,
    known_valid: int | None = None,
    best: Callable[[list[int]], int | None] | None = None,
    floor: int | None = None,
) -> list[int]:
    """Delete checkpoints beyond the newest ``keep_last``, except every ``keep_every``-th step,
    the newest valid one, the one ``best`` picks of the steps there (the best by a metric:
    ``checkpoint.keep_best``) and the newest at or before step ``floor`` (the divergence
    guard's newest from before any divergence); remove leftover temporary directories.
    Returns deleted steps.

    It takes the run's writer lock (a live writer's temporary directory is not leftover);
    ``lock=False`` is for a writer that already holds it. ``known_valid``: a step the caller
    has just committed, taken as the newest valid one without reading it back."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
    root = storage.resolve(root)
    if not storage.exists(root):
        raise CheckpointError(f"{root}: no such run directory")
    with RunLock(root) if lock else contextlib.nullcontext():
        return _prune(root, keep_last, keep_every, known_valid, best, floor)


def _prune(
    root: Location,
    keep_last: int,
    keep_every: int | None,
    known_valid: int | None,
    best: Callable[[list[int]], int | None] | None,
    floor: int | None = None,
) -> list[int]:
    # Replaces cut short first (an unfinished step-N may be mid-replace); then the staging
    # directories, while their steps stand (remove_dir keeps one that is its step's only copy).
    recover(root)
    remove_staged(root)
    all_steps = steps(root)
    if not root.local:  # written in place there: a step directory without a manifest is unfinished
        all_steps = [s for s in all_steps if not storage.remove_unfinished(root.join(f"step-{s}"))]
    keep = set(all_steps[:keep_last])
    if keep_every:
        keep |= {s for s in all_steps if s % keep_every == 0}
    chosen = best(all_steps) if best is not None else None
    if chosen is not None:
        keep.add(chosen)
    before = [s for s in all_steps if floor is not None and s <= floor]
    if before:
        keep.add(before[0])  # newest first
    # full: a checkpoint whose bytes are corrupt but sizes right must not count as the valid one
    if known_valid is not None:
        keep.add(known_valid)
    else:
        newest_valid = latest(root, verify="full").checkpoint
        if newest_valid is not None:
            keep.add(newest_valid.step)
    deleted = []
    for s in all_steps:
        if s not in keep:
            storage.remove_dir(root.join(f"step-{s}"))
            deleted.append(s)
    return deleted


def remove_staged(root: Location) -> None:
    """Remove what writers left in ``step-N.tmp-<id>`` directories (the caller holds the lock,
    so none is being written)."""
    for d in storage.list_dirs(root):
        if ".tmp-" in d and STEP_DIR.match(d.split(".tmp-")[0]):
            storage.remove_dir(root.join(d))


REPLACED_DIR = re.compile(r"^(step-\d+)\.replaced-")


def recover(root: str | Location) -> list[str]:
    """Finish or undo replaces of a checkpoint (``writer.commit(..., replace=True)``) cut short
    by a crash, so that the step again has a whole checkpoint, old or new. For the run's
    writer, holding its lock, before it reads the run; returns what it did, for the log.

    Local: an old checkpoint left as ``step-N.replaced-<id>`` with no ``step-N`` is renamed
    back (the new one, in its ``.tmp-`` directory, goes like any unfinished write); beside a
    ``step-N`` it is a leftover. Object stores: a ``step-N`` without manifest beside a whole
    staged ``step-N.tmp-<id>`` was being replaced by it: the copy is done again (from the
    newest such one, should there be several)."""
    root = storage.resolve(root)
    names = storage.list_dirs(root)
    done = []
    for d in names:
        if (m := REPLACED_DIR.match(d)) is None:
            continue
        final = root.join(m.group(1))
        if storage.exists(final):
            storage.remove_dir(root.join(d))
        else:
            move_dir(root.join(d), final)
            done.append(f"{final}: restored from {d}, left by a replace cut short")
    if root.local:
        return done
    staged: dict[str, Checkpoint] = {}
    for d in names:
        base, sep, _ = d.partition(".tmp-")
        if not sep or not STEP_DIR.match(base) or storage.exists(root.join(base, MANIFEST)):
            continue
        try:
            ck = Checkpoint.open(root.join(d), verify="fast")
        except CheckpointError:
            continue  # unfinished: the old step-N, if any, is whole
        if base not in staged or ck.manifest["created"] > staged[base].manifest["created"]:
            staged[base] = ck
    for base, ck in sorted(staged.items()):
        commit_dir(ck.location, root.join(base), replace=True)
        done.append(f"{root.join(base)}: finished its replace by {ck.location}, cut short")
    return done
