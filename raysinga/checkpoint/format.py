"""Checkpoint format version 1: names, records and the rules every reader and writer follows.

A checkpoint is a directory ``step-<N>`` holding

- ``shard-<K>.arrow``: an Arrow IPC file per server; one record batch per tensor slice with the
  columns ``name, kind, start, stop, shape, dtype, version, data`` (``data``: one large_binary
  value with the slice's raw little-endian bytes, C order);
- ``params.meta``: text, one line per tensor slice (name, kind, shape, dtype, slice, version,
  shard, xxh3-64 of the bytes), readable without this library;
- ``manifest.msgpack``: the format name and version, the step, the caller's metadata (cursor,
  seeds, topology, optimizer, ...) and, for every other file, its size and xxh3-64 checksum.

The manifest is written last and checked first. Nothing is ever unpickled.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

FORMAT_NAME = "raysinga-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.msgpack"
META = "params.meta"
KINDS = ("param", "slot", "state")
DTYPES = (
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
)
STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(Exception):
    """A checkpoint that cannot be trusted or used; the message names the file and the reason."""


@dataclass(frozen=True)
class TensorInfo:
    """One stored slice of a tensor: ``data`` holds elements ``[start, stop)`` of the flat
    tensor of ``shape`` (a whole tensor is the slice ``[0, size)``)."""

    name: str
    kind: str  # "param" (trainable), "slot" (optimizer state), "state" (e.g. running mean)
    shape: tuple[int, ...]
    dtype: str
    start: int
    stop: int
    version: int = 0
    shard: int = 0

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # Python ints: a crafted shape cannot overflow

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * np.dtype(self.dtype).itemsize

    def check(self) -> None:
        if not self.name or "\n" in self.name or "\t" in self.name:
            raise CheckpointError(f"tensor name {self.name!r}: must be non-empty, no tabs/newlines")
        if self.kind not in KINDS:
            raise CheckpointError(f"tensor {self.name!r}: kind {self.kind!r} not in {KINDS}")
        if self.dtype not in DTYPES:
            raise CheckpointError(f"tensor {self.name!r}: dtype {self.dtype!r} not in {DTYPES}")
        if any(d < 0 for d in self.shape) or not 0 <= self.start <= self.stop <= self.size:
            raise CheckpointError(
                f"tensor {self.name!r}: slice [{self.start}, {self.stop}) does not fit shape "
                f"{self.shape}"
            )

    def meta_line(self, checksum: str) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return (
            f"{self.name}\t{self.kind}\t{shape}\t{self.dtype}\t{self.start}:{self.stop}\t"
            f"{self.version}\tshard-{self.shard}\txxh3:{checksum}"
        )


def check_layout(infos: Iterable[TensorInfo]) -> None:
    """The slices of each name agree on kind, shape and dtype (else a read would cast one
    silently) and tile ``[0, size)`` exactly: no overlap (``flat_range`` would count elements
    twice and leave others unset), no gap, no slice twice. Checked at open, for every tensor, so
    that every later read may rely on it."""
    by_name: dict[str, list[TensorInfo]] = {}
    for i in infos:
        by_name.setdefault(i.name, []).append(i)
    for name, slices in by_name.items():
        for what in ("kind", "shape", "dtype"):
            seen = sorted({str(getattr(i, what)) for i in slices})
            if len(seen) > 1:
                raise CheckpointError(
                    f"tensor {name!r}: slices disagree on {what} ({' vs '.join(seen)})"
                )
        slices.sort(key=lambda i: (i.start, i.stop))
        why = _untiled(slices)
        if why is not None:
            ranges = ", ".join(f"[{i.start}, {i.stop})" for i in slices[:8])
            raise CheckpointError(
                f"tensor {name!r}: slices {ranges}{', ...' if len(slices) > 8 else ''} do not "
                f"tile [0, {slices[0].size}): {why}"
            )


def _untiled(slices: list[TensorInfo]) -> str | None:
    """Why ``slices`` (of one tensor, sorted by start) do not tile it; None when they do."""
    stop = 0
    for k, i in enumerate(slices):
        p = slices[k - 1]  # the slice before (not looked at for the first)
        if k and i.start == p.start:  # readers find a slice by (name, start)
            if i.stop == p.stop:
                return f"[{i.start}, {i.stop}) is listed twice"
            return f"[{p.start}, {p.stop}) and [{i.start}, {i.stop}) start together"
        if i.start < stop:
            return f"[{i.start}, {i.stop}) overlaps [{p.start}, {p.stop})"
        if i.start > stop:
            return f"[{stop}, {i.start}) is missing"
        stop = i.stop
    return None if stop == slices[0].size else f"[{stop}, {slices[0].size}) is missing"


def as_array(a: Any) -> np.ndarray:
    """A C-contiguous little-endian array of a supported dtype (no copy when it already is)."""
    arr = np.asarray(a)
    if arr.dtype.byteorder == ">":  # before the check: str() of a big-endian dtype is ">i4"
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if str(arr.dtype) not in DTYPES:
        raise CheckpointError(f"dtype {arr.dtype} cannot be stored; supported: {DTYPES}")
    return np.ascontiguousarray(arr)
