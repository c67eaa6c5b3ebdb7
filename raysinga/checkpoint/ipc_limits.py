"""What Arrow would allocate to decompress a shard, read before Arrow is let near it.

Arrow takes each compressed buffer's length from the 8 bytes in front of it and allocates that
much before decompressing, so a few KB of a crafted shard can make it allocate gigabytes. The
manifest bounds what a shard's records may hold (:func:`decompressed_limit`), and the bound
protects only if it is checked before Arrow decompresses anything. pyarrow gives no way to: it
hands out an IPC message's metadata only as raw flatbuffer bytes (``Message.metadata``), never
parsed into the body's buffers and their lengths, and reading a batch decompresses it. So
those lengths are read here by hand from the file's own metadata (flatbuffers: ``Footer``,
``Message`` and ``RecordBatch`` of Arrow's ``File.fbs`` / ``Message.fbs``), with every offset
checked against the file's bounds: the file is untrusted.
"""

from __future__ import annotations

import struct
from typing import Any

from .format import TensorInfo

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


def footer_blocks(data: Any) -> tuple[int, int, int]:
    """Where the footer of the Arrow IPC file ``data`` starts, where its record-batch blocks
    (``Block``: offset int64, metaDataLength int32, 4 bytes of padding, bodyLength int64) start,
    and how many there are. ValueError if the file lists dictionary batches (a shard has none)."""
    buf = memoryview(data).cast("B")
    if bytes(buf[:6]) != b"ARROW1" or bytes(buf[-6:]) != b"ARROW1":
        raise ValueError("no Arrow file magic")
    start = len(buf) - 10 - _read(buf, "i", len(buf) - 10)
    footer = start + _read(buf, "I", start)
    if _vector(buf, footer, 2)[1]:
        raise ValueError("dictionary batches")
    blocks, n = _vector(buf, footer, 3)
    return start, blocks, n


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
    _, blocks, n = footer_blocks(buf)
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
