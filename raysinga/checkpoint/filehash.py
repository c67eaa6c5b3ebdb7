"""Hashing a checkpoint's files (xxh3-64) as fast as the device reads them.

A full verify reads every byte of every shard, so it is bound by the device: locally the file
is hashed through a memory map (no copy out of the page cache) while threads read the pieces not
yet cached just ahead of the hasher; on other filesystems it is streamed in large pieces.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Any

import numpy as np
import xxhash

from .storage import Location

READ_PIECE = 32 << 20  # what one read-ahead thread asks of the device at a time
READ_AHEAD_MIN = 2 * READ_PIECE  # smaller files are read by the hasher alone
_STREAM_PIECE = 16 << 20  # what one read of a non-local file asks for


def hash_file(loc: Location, readers: int = 4) -> str:
    """The xxh3-64 hex digest of the file at ``loc`` (``readers``: see :func:`hash_local_file`)."""
    if loc.local:
        return hash_local_file(loc.path, readers)[1]
    h = xxhash.xxh3_64()
    with loc.fs.open_input_stream(loc.path) as f:
        while chunk := f.read(_STREAM_PIECE):
            h.update(chunk)
    return h.hexdigest()


def hash_local_file(path: str, readers: int = 4) -> tuple[int, str]:
    """(size, xxh3 hex digest) of a local file, hashed through a memory map: no copy out of the
    page cache. The hash is one sequential pass; on a cold file ``readers`` threads read the
    pieces not yet cached just ahead of it, so several reads are in flight at once (one
    sequential reader leaves most devices idle between its requests)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0, xxhash.xxh3_64_hexdigest(b"")
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            absent = _absent_pieces(m, size) if size >= READ_AHEAD_MIN and readers > 0 else []
            with _ReadAhead(f.fileno(), absent, size, readers), memoryview(m) as mv:
                return size, xxhash.xxh3_64_hexdigest(mv)


def _load_mincore() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_MINCORE = _load_mincore()


def _absent_pieces(m: mmap.mmap, size: int) -> list[int]:
    """Offsets of the READ_PIECE-sized pieces of a mapped file that have a page outside the
    page cache (every piece where the kernel cannot say)."""
    pieces = range(0, size, READ_PIECE)
    if _MINCORE is None:
        return list(pieces)
    page = mmap.PAGESIZE
    vec = np.empty((size + page - 1) // page, np.uint8)
    view = np.frombuffer(m, np.uint8)
    try:
        failed = _MINCORE(view.ctypes.data, size, vec.ctypes.data) != 0
    finally:
        del view  # the map cannot close while a view of it exists
    if failed:
        return list(pieces)
    cached = (vec & 1).astype(bool)
    per = READ_PIECE // page
    return [off for off in pieces if not cached[off // page : off // page + per].all()]


class _ReadAhead:
    """Threads that read the given pieces of a file, in order, into the page cache while they
    last. A hint only: a failed read stops its thread, and the consumer's own reads report."""

    def __init__(self, fd: int, offsets: list[int], size: int, threads: int) -> None:
        self._fd, self._size = fd, size
        self._next, self._lock = iter(offsets), threading.Lock()
        self._stop = threading.Event()
        n = min(threads, len(offsets))
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def __enter__(self) -> _ReadAhead:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        scratch = memoryview(bytearray(1 << 20))
        try:
            while not self._stop.is_set():
                with self._lock:
                    off = next(self._next, None)
                if off is None:
                    return
                end = min(off + READ_PIECE, self._size)
                while off < end and not self._stop.is_set():
                    got = os.preadv(self._fd, [scratch[: min(len(scratch), end - off)]], off)
                    if got <= 0:
                        return
                    off += got
        except OSError:
            return
