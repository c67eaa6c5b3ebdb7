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
import struct
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


# --- what Arrow would allocate to decompress a shard --------------------------------------------
# Arrow takes each compressed buffer's length from the 8 bytes in front of it and allocates that
# much before decompressing, so a few KB of a crafted shard can make it allocate gigabytes. These
# lengths are read here from the IPC file's own metadata (flatbuffers: Footer, Message and
# RecordBatch of Arrow's File.fbs / Message.fbs), without decompressing anything, so that a
# reader can hold them against what the manifest allows first.

_RECORD_BATCH = 3  # MessageHeader union tag
_CONTINUATION = 0xFFFFFFFF


def _read(buf: memoryview, fmt: str, at: int) -> Any:
    if not 0 <= at <= len(buf) - struct.calcsize("<" + fmt):
        raise ValueError(f"an offset ({at}) outside the file")
    return struct.unpack_from("<" + fmt, buf, at)[0]


def _field(buf: memoryview, table: int, i: int) -> int | None:
    """Where field ``i`` of the flatbuffer table at ``table`` lies, or None when it is absent."""
    vtable = table - _read(buf, "i", table)
    if 4 + 2 * i >= _read(buf, "H", vtable):
        return None
    off = _read(buf, "H", vtable + 4 + 2 * i)
    return table + off if off else None


def _vector(buf: memoryview, table: int, i: int) -> tuple[int, int]:
    """(first element, length) of the vector in field ``i``; an absent one is empty."""
    at = _field(buf, table, i)
    if at is None:
        return 0, 0
    at += _read(buf, "I", at)
    return at + 4, _read(buf, "I", at)


def decompressed_limit(info: TensorInfo) -> int:
    """The most the record of ``info`` may decompress to: its data, plus a generous bound on
    the other columns (Arrow's writer takes about 70 bytes besides the strings and the shape)."""
    strings = len(info.name.encode()) + len(info.kind) + len(info.dtype)
    return info.nbytes + strings + 8 * len(info.shape) + 256


def decompressed_sizes(data: Any) -> list[int]:
    """For each record batch of the Arrow IPC file ``data`` (bytes-like), the bytes Arrow would
    allocate to decompress it: 0 for an uncompressed batch. ValueError if the file is not laid
    out as Arrow reads it, or lists dictionary batches (a shard has none)."""
    buf = memoryview(data).cast("B")
    if bytes(buf[:6]) != b"ARROW1" or bytes(buf[-6:]) != b"ARROW1":
        raise ValueError("no Arrow file magic")
    footer = len(buf) - 10 - _read(buf, "i", len(buf) - 10)
    footer += _read(buf, "I", footer)
    if _vector(buf, footer, 2)[1]:
        raise ValueError("dictionary batches")
    blocks, n = _vector(buf, footer, 3)
    out = []
    for k in range(n):  # Block: offset (int64), metaDataLength (int32, 4 pad), bodyLength
        at, meta_len = _read(buf, "q", blocks + 24 * k), _read(buf, "i", blocks + 24 * k + 8)
        fb = at + 8 if _read(buf, "I", at) == _CONTINUATION else at + 4
        message = fb + _read(buf, "I", fb)
        kind = _field(buf, message, 1)
        if kind is None or _read(buf, "B", kind) != _RECORD_BATCH:
            raise ValueError("a block that is not a record batch")
        body_at, body_len = at + meta_len, _field(buf, message, 3)
        body_len = 0 if body_len is None else _read(buf, "q", body_len)
        header = _field(buf, message, 2)
        if header is None:
            raise ValueError("a message without a header")
        batch = header + _read(buf, "I", header)
        total = 0
        if _field(buf, batch, 3) is not None:  # compressed: each buffer says its length first
            first, count = _vector(buf, batch, 2)
            for b in range(count):  # Buffer: offset, length (int64 both), within the body
                off, length = _read(buf, "q", first + 16 * b), _read(buf, "q", first + 16 * b + 8)
                if length == 0:
                    continue
                if not (0 <= off and 8 <= length and off + length <= body_len):
                    raise ValueError("a compressed buffer outside its body")
                size = _read(buf, "q", body_at + off)
                if size < -1:
                    raise ValueError("a negative buffer length")
                total += max(size, 0)  # -1: stored uncompressed, read in place
        out.append(total)
    return out
