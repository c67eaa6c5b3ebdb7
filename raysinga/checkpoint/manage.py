"""Run directories of checkpoints: save in one call, find the newest valid one, prune."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from . import storage, writer
from .format import STEP_DIR, CheckpointError, TensorInfo
from .reader import Checkpoint
from .storage import Location, RunLock


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
) -> Location:
    """Save whole tensors as a one-shard checkpoint ``<root>/step-<step>`` (single process)."""
    root = storage.resolve(root)
    run_lock = RunLock(root) if lock else None
    if run_lock:
        run_lock.acquire()
    try:
        tmp = writer.begin(root, step)
        try:
            pairs = (
                tensors_of(params, "param")
                + tensors_of(slots or {}, "slot")
                + tensors_of(state or {}, "state")
            )
            shard = writer.write_shard(tmp, 0, pairs, compression)
            return writer.commit(tmp, step, [shard], meta)
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
) -> list[int]:
    """Delete checkpoints beyond the newest ``keep_last``, except every ``keep_every``-th step
    and the newest valid one; remove leftover temporary directories. Returns deleted steps.

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
        return _prune(root, keep_last, keep_every, known_valid)


def _prune(
    root: Location, keep_last: int, keep_every: int | None, known_valid: int | None
) -> list[int]:
    all_steps = steps(root)
    if not root.local:  # written in place there: a step directory without a manifest is unfinished
        all_steps = [s for s in all_steps if not storage.remove_unfinished(root.join(f"step-{s}"))]
    keep = set(all_steps[:keep_last])
    if keep_every:
        keep |= {s for s in all_steps if s % keep_every == 0}
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
    for d in storage.list_dirs(root):
        if ".tmp-" in d and STEP_DIR.match(d.split(".tmp-")[0]):
            storage.remove_dir(root.join(d))
    return deleted
