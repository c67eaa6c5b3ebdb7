"""Data files behind a URI (``s3://bucket/key?endpoint_override=...``, any pyarrow filesystem),
read by byte range through the node's block cache (:mod:`raysinga.data.cache`).

:class:`RemoteFile` is a seekable Python file; wrapped in ``pa.PythonFile`` it is what
``pq.ParquetFile`` and ``pa.ipc.open_file`` read, so remote files go through the same code as
local ones and a read touches only the blocks holding the bytes asked for. Blocks are cached
under a key made of the URI without its credentials, the object's size and its version (ETag and
Last-Modified where the store gives them, else the modification time): a rewritten object gets
other keys and is never served from the blocks of its former contents.

Credentials in a URI stay in memory: every message names the URI :func:`storage.redact`-ed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from raysinga.checkpoint.storage import redact, redact_text

from .cache import BlockCache, CacheSpec
from .errors import DataError
from .sources import open_map

MEMORY_BLOCKS = 2  # blocks a file keeps in memory: a footer is read in several small pieces
METADATA_THREADS = 16  # concurrent small reads of Arrow IPC batch headers


def is_uri(path: str | os.PathLike[str]) -> bool:
    return "://" in os.fspath(path)


def what(path: str | os.PathLike[str]) -> str:
    """``path`` as messages name it: a URI without its credentials."""
    return redact(os.fspath(path))


class RemoteFile(io.RawIOBase):
    """The object at ``uri``, read-only, in blocks of ``cache.block_bytes`` through the cache.

    ``fetches`` counts the blocks read from the store (the cache's misses) by this object.
    """

    def __init__(self, uri: str, cache: CacheSpec) -> None:
        super().__init__()
        self.uri, self.name = uri, what(uri)
        try:
            fs, path = pafs.FileSystem.from_uri(uri)
        except (ValueError, OSError, TypeError) as e:
            raise DataError(
                f"cannot open this location: {redact_text(str(e))}", file=self.name
            ) from None
        self._handle = _open_object(fs, path, self.name)
        self.size = self._handle.size()
        if self.size == 0:
            raise DataError("is empty (0 bytes)", file=self.name)
        meta = self._handle.metadata() or {}
        version = [meta.get(k, b"").decode(errors="replace") for k in ("ETag", "Last-Modified")]
        if not any(version):  # filesystems without object metadata: the modification time
            version = [str(fs.get_file_info(path).mtime_ns)]
        ident = "\n".join([self.name, str(self.size), *version, str(cache.block_bytes)])
        self.key = hashlib.sha256(ident.encode()).hexdigest()[:32]
        self.block_bytes = cache.block_bytes
        self.fetches = 0
        self._cache = BlockCache(cache)
        self._memory: OrderedDict[int, bytes] = OrderedDict()
        self._pos = 0

    # -- the io interface pa.PythonFile uses
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(f"{self.name}: seek to {base + offset}, before the start")
        self._pos = base + offset
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        start = min(self._pos, self.size)
        stop = self.size if n is None or n < 0 else min(self.size, start + n)
        self._pos = stop
        return self.read_at(start, stop - start)

    def read_at(self, offset: int, n: int) -> bytes:
        """``n`` bytes from ``offset``, from the blocks that hold them."""
        if n <= 0:
            return b""
        b = self.block_bytes
        parts = []
        for i in range(offset // b, (offset + n - 1) // b + 1):
            block = self._block(i)
            lo = max(offset - i * b, 0)
            parts.append(block[lo : min(offset + n - i * b, len(block))])
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._handle.close()
        super().close()

    # -- blocks
    def _block(self, i: int) -> bytes:
        if i in self._memory:
            self._memory.move_to_end(i)
            return self._memory[i]
        lo = i * self.block_bytes
        length = min(self.block_bytes, self.size - lo)
        data = self._cache.get(f"{self.key}-{i:08d}.blk", length, lambda: self._fetch(lo, length))
        self._memory[i] = data
        if len(self._memory) > MEMORY_BLOCKS:
            self._memory.popitem(last=False)
        return data

    def cached(self, name: str, length: int, compute: Callable[[], bytes]) -> bytes:
        """A ``length``-byte entry of this object's own (``name`` after its key) in the cache."""
        return self._cache.get(f"{self.key}-{name}.blk", length, compute)

    def _fetch(self, offset: int, n: int) -> bytes:
        self.fetches += 1
        return self.read_uncached(offset, n)

    def read_uncached(self, offset: int, n: int) -> bytes:
        """One ranged read from the store, past the cache."""
        try:
            return self._handle.read_at(n, offset)
        except OSError as e:
            raise DataError(
                f"bytes {offset}..{offset + n - 1} cannot be read: {redact_text(str(e))}",
                file=self.name,
            ) from None


def _open_object(fs: pafs.FileSystem, path: str, name: str) -> pa.NativeFile:
    """The object at ``path`` opened for ranged reads (on S3: one HEAD request)."""
    try:
        return fs.open_input_file(path)
    except OSError as e:
        info = None
        with contextlib.suppress(OSError):
            info = fs.get_file_info(path)
        if info is not None and info.type == pafs.FileType.Directory:
            raise DataError("is a directory (a prefix), not an object", file=name) from None
        if isinstance(e, FileNotFoundError):
            raise FileNotFoundError(f"{name}: no such object (or no such bucket)") from None
        raise DataError(f"cannot be read: {redact_text(str(e))}", file=name) from None


@dataclass
class Source:
    """A data file opened for pyarrow: ``file`` to read, ``name`` for messages, and the
    :class:`RemoteFile` behind ``file`` when the file lies behind a URI."""

    file: pa.NativeFile
    name: str
    remote: RemoteFile | None = None


def open_source(path: str | os.PathLike[str], cache: CacheSpec | None = None) -> Source:
    """A local path memory-mapped (a ``file://`` URI too), anything else read through the cache."""
    path = os.fspath(path)
    if not is_uri(path):
        return Source(open_map(path), path)
    if path.startswith("file://"):
        local = pafs.FileSystem.from_uri(path)[1]
        return Source(open_map(local, file=what(path)), what(path))
    remote = RemoteFile(path, cache or CacheSpec())
    return Source(pa.PythonFile(remote, mode="r"), remote.name, remote)


# ---------------------------------------------------------------- Arrow IPC batch lengths
# An IPC file's footer lists where each record batch lies but not its rows; those are in each
# batch's header, in front of its body. pyarrow has no call that reads headers alone (get_batch
# and count_rows read bodies too: the whole file), so the two flatbuffers are read here, and the
# lengths kept in the cache beside the blocks for the next process on the node.

_BLOCK = struct.Struct("<qi4xq")  # Block: offset, metaDataLength, (padding), bodyLength
_RECORD_BATCH = 3  # MessageHeader union member RecordBatch


def _field(buf: bytes, table: int, index: int) -> int | None:
    """Absolute position of field ``index`` of the flatbuffer table at ``table``, or None."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    vsize = struct.unpack_from("<H", buf, vtable)[0]
    if 4 + 2 * index >= vsize:
        return None
    off = struct.unpack_from("<H", buf, vtable + 4 + 2 * index)[0]
    return table + off if off else None


def _ref(buf: bytes, at: int) -> int:
    return at + struct.unpack_from("<I", buf, at)[0]


def _batch_blocks(footer: bytes) -> list[tuple[int, int]]:
    """(offset, metadata length) of each record batch, from the Footer flatbuffer."""
    at = _field(footer, _ref(footer, 0), 3)  # Footer.recordBatches
    if at is None:
        return []
    vec = _ref(footer, at)
    count = struct.unpack_from("<I", footer, vec)[0]
    blocks = [_BLOCK.unpack_from(footer, vec + 4 + i * _BLOCK.size) for i in range(count)]
    return [(offset, meta) for offset, meta, _ in blocks]


def _batch_length(header: bytes) -> int:
    """RecordBatch.length from an encapsulated message (continuation marker, size, Message)."""
    start = 8 if header[:4] == b"\xff\xff\xff\xff" else 4  # files before format 0.15: no marker
    buf = header[start:]
    message = _ref(buf, 0)
    kind = _field(buf, message, 1)  # Message.header_type
    body = _field(buf, message, 2)  # Message.header
    if kind is None or buf[kind] != _RECORD_BATCH or body is None:
        raise ValueError("a record batch block does not hold a record batch")
    length = _field(buf, _ref(buf, body), 0)  # RecordBatch.length
    return 0 if length is None else struct.unpack_from("<q", buf, length)[0]


def ipc_batch_rows(remote: RemoteFile) -> list[int]:
    """The rows of each record batch of the Arrow IPC file ``remote``, reading only headers.

    Raises ValueError (or struct.error) on a file that is not an IPC file.
    """
    tail = remote.read_at(remote.size - 10, 10)
    if remote.size < 18 or tail[4:] != b"ARROW1":
        raise ValueError("no ARROW1 magic at its end")
    footer_len = struct.unpack_from("<i", tail)[0]
    if not 0 < footer_len <= remote.size - 18:
        raise ValueError(f"footer length {footer_len} out of range")
    blocks = _batch_blocks(remote.read_at(remote.size - 10 - footer_len, footer_len))

    def compute() -> bytes:
        with ThreadPoolExecutor(METADATA_THREADS) as pool:
            headers = pool.map(lambda b: remote.read_uncached(*b), blocks)
            return np.array([_batch_length(h) for h in headers], dtype="<i8").tobytes()

    # kept like a block (and evicted like one: recomputed when gone)
    rows = remote.cached("rows", 8 * len(blocks), compute) if blocks else b""
    return [int(n) for n in np.frombuffer(rows, dtype="<i8")]
