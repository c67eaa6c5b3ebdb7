"""A compressed shard whose record batches that compression does not shrink are stored raw.

Arrow's IPC writer compresses every buffer of every record batch with the codec it is given,
whether or not that pays: a slice of random float weights comes out larger under LZ4 (a frame
header and an 8-byte length for each of a record's ten or so buffers). Arrow marks compression
per record batch (the ``compression`` field of its ``RecordBatch`` message; without it the
batch is stored raw), so one file may mix both kinds and every Arrow reader reads it. Here each
record batch is serialized both ways and the shorter message is written, so a compressed shard
is never larger than the uncompressed one. pyarrow has no writer that chooses per batch: the
file is assembled from the messages, behind the header and before the footer of a file Arrow
wrote with as many (empty) record batches, the footer's blocks set to where the messages are.
"""

from __future__ import annotations

import struct
from typing import Any

import pyarrow as pa

from .ipc_limits import footer_blocks

_EOS = 8  # the end-of-stream marker a stream writer closes with
_BLOCK = struct.Struct("<qi4xq")  # File.fbs Block: offset, metaDataLength, (pad), bodyLength


def _stream(schema: pa.Schema, batches: list[pa.RecordBatch], opts: Any) -> bytes:
    out = pa.BufferOutputStream()
    with pa.ipc.new_stream(out, schema, options=opts) as w:
        for b in batches:
            w.write_batch(b)
    return out.getvalue().to_pybytes()


class MixedWriter:
    """Writes an Arrow IPC file of ``n`` record batches of ``schema`` into ``sink`` (a file-like
    object with ``write``), each batch compressed with ``compression`` where that makes its
    message shorter, else raw. Use :meth:`write_batch` ``n`` times, then :meth:`close`."""

    def __init__(self, sink: Any, schema: pa.Schema, compression: str, n: int) -> None:
        self._sink, self._schema, self._n = sink, schema, n
        self._raw = pa.ipc.IpcWriteOptions()
        self._packed = pa.ipc.IpcWriteOptions(compression=compression)
        self._skip = len(_stream(schema, [], self._raw)) - _EOS  # the schema message
        out = pa.BufferOutputStream()
        # of no Python values (from_pylist makes pyarrow import pandas, where installed)
        empty = pa.RecordBatch.from_arrays([pa.nulls(0, f.type) for f in schema], schema=schema)
        with pa.ipc.new_file(out, schema) as w:
            for _ in range(n):
                w.write_batch(empty)
        self._template = t = memoryview(out.getvalue().to_pybytes())
        self._footer_at, first, count = footer_blocks(t)
        assert count == n, "Arrow wrote a footer with another number of record batches"
        self._blocks_at = first - self._footer_at  # within the footer
        if n:
            (self._pos,) = struct.unpack_from("<q", t, first)  # the first batch's offset
            off, meta, body = _BLOCK.unpack_from(t, first + _BLOCK.size * (n - 1))
            self._gap = t[off + meta + body : self._footer_at]  # Arrow's end-of-stream marker
        else:
            self._pos, self._gap = self._footer_at, t[:0]
        sink.write(t[: self._pos])
        self._blocks: list[tuple[int, int, int]] = []
        self.compressed = 0  # how many batches were written compressed

    def message(self, batch: pa.RecordBatch) -> tuple[bytes, bool]:
        """The IPC message of ``batch`` to write, and whether it is the compressed one."""
        raw = _stream(self._schema, [batch], self._raw)[self._skip : -_EOS]
        packed = _stream(self._schema, [batch], self._packed)[self._skip : -_EOS]
        return (packed, True) if len(packed) < len(raw) else (raw, False)

    def write_batch(self, batch: pa.RecordBatch) -> None:
        if len(self._blocks) == self._n:
            raise ValueError(f"this file was laid out for {self._n} record batches")
        msg, packed = self.message(batch)
        (flatbuffer,) = struct.unpack_from("<i", msg, 4)  # after the continuation marker
        self._blocks.append((self._pos, 8 + flatbuffer, len(msg) - 8 - flatbuffer))
        self._sink.write(msg)
        self._pos += len(msg)
        self.compressed += packed

    def close(self) -> None:
        if len(self._blocks) != self._n:
            raise ValueError(f"{len(self._blocks)} of {self._n} record batches written")
        t = self._template
        footer = bytearray(t[self._footer_at : len(t) - 10])
        for k, block in enumerate(self._blocks):
            _BLOCK.pack_into(footer, self._blocks_at + _BLOCK.size * k, *block)
        self._sink.write(self._gap)
        self._sink.write(footer)
        self._sink.write(t[len(t) - 10 :])  # the footer's length and the closing magic
