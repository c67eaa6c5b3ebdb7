"""A parameter server's shard of a checkpoint: what the server needs of the checkpoint
format, and no more.

A server saves its slices and their optimizer slots as one shard of a checkpoint (checked for
non-finite values on the copy, off the training path), and loads its slices back from any
checkpoint whatever slicing wrote it. How tensors are named and described,
where the optimizer's description sits in the manifest and how a shard file is laid out stay the
checkpoint code's business; the server sees only the functions below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from raysinga.checkpoint import Checkpoint, CheckpointError
from raysinga.checkpoint.format import TensorInfo
from raysinga.checkpoint.writer import ShardImage, copy_in_chunks, write_shard
from raysinga.run import state as run_state
from raysinga.run.finite import check_finite_state

__all__ = [
    "CheckpointSource",
    "ShardImage",
    "SliceLike",
    "Tensors",
    "by_slice",
    "check_and_write",
    "copy_in_chunks",
    "load_slices",
    "shard_tensors",
    "verify",
    "write_shard",
]

# A shard's tensors in file order: what each is, and its values.
Tensors = list[tuple[TensorInfo, np.ndarray]]


class SliceLike(Protocol):
    """A flat element range ``[start, stop)`` of parameter ``param``, known by ``name`` (a
    server's ``Slice``; read-only, as a frozen dataclass's fields are)."""

    @property
    def param(self) -> str: ...

    @property
    def start(self) -> int: ...

    @property
    def stop(self) -> int: ...

    @property
    def name(self) -> str: ...


class CheckpointSource(Protocol):
    """Where a checkpoint to load from lives (a directory or a copy in Ray's object store)."""

    def open(self, verify: str = "fast") -> Checkpoint: ...

    def verify_files(self, ck: Checkpoint, files: list[str]) -> None: ...


def shard_tensors(
    slices: Sequence[SliceLike],
    shapes: dict[str, tuple[int, ...]],
    values: dict[str, np.ndarray],
    slots: dict[str, dict[str, np.ndarray]],
    version: int,
) -> Tensors:
    """A server's shard: its parameter slices, then their optimizer slots (``values`` and
    ``slots`` keyed by slice name; a slice not updated yet may have no slots)."""
    return run_state.slice_tensors(list(slices), shapes, values, slots, version)


def load_slices(
    source: CheckpointSource,
    slices: Sequence[SliceLike],
    into: dict[str, np.ndarray],
    resume: bool,
    names: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any] | None]:
    """Overwrite ``into[slice name]`` (flat) with each slice's values in the checkpoint,
    whatever slicing wrote it.

    ``resume``: every slice, under its own parameter's name. Otherwise (``--init-from``) only
    the parameters in ``names`` (model name -> checkpoint name). Slices are read one at a time
    into place, so a server never holds a second copy of all of its values.

    Returns the number of elements loaded and, when resuming, the optimizer state of these
    slices for ``Optimizer.load_state_dict`` (the checkpoint's hyperparameters and schedule are
    authoritative); else None.
    """
    ck = source.open(verify="fast")
    loaded = 0
    for s in slices:
        stored = s.param if resume else (names or {}).get(s.param)
        if stored is None:
            continue  # not in the checkpoint: keeps its initial values
        into[s.name][...] = ck.flat_range(stored, s.start, s.stop)
        loaded += s.stop - s.start
    return loaded, (_optimizer_state(ck, slices) if resume else None)


def _optimizer_state(ck: Checkpoint, slices: Sequence[SliceLike]) -> dict[str, Any]:
    """The optimizer's state dict for ``slices``, keyed by slice name as the server's
    optimizer keys them (``"<slice>/<slot>"``)."""
    opt = run_state.run_info(ck)["optimizer"]
    slots, counts = {}, {}
    for s in slices:
        counts[s.name] = int(opt["counts"].get(s.param, 0))
        for slot in run_state.slot_names(ck, s.param):
            slots[f"{s.name}/{slot}"] = ck.flat_range(f"{s.param}/{slot}", s.start, s.stop)
    return {
        "name": opt["name"],
        "hparams": opt["hparams"],
        "schedule": opt["schedule"],
        "slots": slots,
        "counts": counts,
    }


def verify(source: CheckpointSource, files: list[str]) -> str | None:
    """Hash ``files`` of a checkpoint against its manifest: None when they match, else what is
    wrong."""
    try:
        source.verify_files(source.open(verify="fast"), files)
    except CheckpointError as e:
        return str(e)
    return None


def check_and_write(
    tensors: Tensors,
    version: int,
    tmp: Any,
    shard: int,
    compression: str | None,
    image: Any,
    pace: Callable[[], None],
) -> dict[str, Any]:
    """Check a snapshot's copy and write it as its shard: on the copy, off the training path
    (a non-finite state is never committed), ``pace()`` before each piece."""
    check_finite_state(((i.name, a) for i, a in tensors), version, pace)
    return write_shard(tmp, shard, tensors, compression, image, pace)


def by_slice(slots: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """An optimizer's slots (keyed ``"<slice>/<slot>"``) by slice name, then slot name."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, a in slots.items():
        name, _, slot = key.rpartition("/")
        out.setdefault(name, {})[slot] = np.asarray(a)
    return out
