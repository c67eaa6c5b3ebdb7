"""Where a shard's bytes go: the file-like object Arrow's IPC writer writes into.

Every byte is hashed (xxh3) on its way out, on a helper thread, so the file's checksum costs no
extra pass over the data. On local disk the tensors' own checksums come from the same pass: a
tensor announced with :meth:`ShardSink.expect` is hashed a piece at a time right after the
file's hash read that piece, from the cache rather than from memory.

On local disk the bytes are gathered into page-aligned staging buffers and written with
``O_DIRECT`` while the next buffer fills: no page-cache copy, no dirty pages to flush at
``fsync``, and a checkpoint does not push the training job's own pages out of memory. Where the
filesystem refuses ``O_DIRECT`` (older tmpfs, some network filesystems), or with
``RAYSINGA_CHECKPOINT_DIRECT=0``, the same buffers go through the page cache and the kernel is
asked to start writing each one back at once (``sync_file_range``), so the closing ``fsync``
finds little left to do.

A writer that laid the shard out in memory beforehand (:class:`.writer.ShardImage`: each tensor
already at its file offset in one page-aligned region) passes that region as ``image``: tensor
bytes Arrow hands over from their place in it are not copied at all, and the file is written
straight from it. The whole file being in memory, its hashing does not wait for the disk: it
runs as fast as the data is placed, while the writes follow at the disk's pace. A parameter
server's checkpoint is hashed in the time its workers compute the next step, not spread over
the server's memory-bound update.

Elsewhere (object stores) the bytes go to the filesystem's output stream as they come.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from . import storage
from .storage import Location

# RAYSINGA_CHECKPOINT_DIRECT=0 turns O_DIRECT off (for a filesystem that takes it but misbehaves)
DIRECT = os.environ.get("RAYSINGA_CHECKPOINT_DIRECT", "1") != "0" and hasattr(os, "O_DIRECT")
STAGE = 8 << 20  # bytes per staging buffer (a multiple of every block size O_DIRECT needs)
NBUF = 4  # staging buffers: one filling, the others being hashed and written
BLOCK = 4096  # O_DIRECT writes are whole blocks; the file is cut back to size at the end
PIECE = 16 << 20  # stream writes (and their hashing) per call on large buffers
HASH_PIECE = 1 << 20  # bytes of an image hashed at once, for the file and the tensor in them


def address(mv: memoryview) -> int:
    """Where a (non-empty) buffer's bytes are in memory."""
    return int(np.frombuffer(mv, np.uint8).ctypes.data)


def _unpaced() -> None:
    pass


class ShardSink:
    """``pace``: called before each piece of the hashing and each write on local disk; a
    writer that must leave room to other work waits in it (see ``actors.memory.snapshots``)."""

    def __init__(
        self,
        loc: Location,
        image: mmap.mmap | None = None,
        pace: Callable[[], None] | None = None,
    ) -> None:
        self.hash, self.size, self.closed = xxhash.xxh3_64(), 0, False
        self._io = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")
        self._local = loc.local
        self._expected: _Span | None = None  # a tensor announced by expect()
        if self._local:
            pace = pace or _unpaced
            self._file: Any = (
                _StagedFile(loc.path, self.hash, self._io, pace)
                if image is None
                else _ImageFile(loc.path, self.hash, self._io, pace, image)
            )
        else:
            self._file = loc.fs.open_output_stream(loc.path)

    # -- the file-like interface Arrow's PythonFile calls
    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        if self._local:
            span = self._expected
            if span is not None and n == span.n and address(mv) == span.addr:
                span.start, span.end, self._expected = self.size, self.size + n, None
                self._file.spans.append(span)
            self._file.write(mv)
        else:
            for i in range(0, n, PIECE):  # hash one piece while the stream takes it
                piece = mv[i : i + PIECE]
                hashed = self._io.submit(self.hash.update, piece)
                try:
                    self._file.write(piece)
                finally:
                    hashed.result()
        self.size += n
        return n

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True  # Arrow closing its writer; the file is finished by finish()

    # -- ours
    def finish(self) -> None:
        """Write out what is staged and make the file durable (local: fsync)."""
        if self._local:
            self._file.finish(self.size)
        else:
            self._file.close()
        self.release()

    def release(self) -> None:
        """Free the file and the helper thread (after finish, or after a failure)."""
        if self._local:
            self._file.release()
        elif not self._file.closed:
            self._file.close()
        self._io.shutdown(wait=True)

    def hexdigest(self) -> str:
        return self.hash.hexdigest()

    def expect(self, mv: memoryview) -> _Span | None:
        """Announce a tensor's bytes, about to be written: where Arrow writes them whole (from
        their own memory), they are hashed in the file's pass (see :meth:`took`). ``None``
        where this sink cannot (an empty tensor, a stream): the caller hashes them itself."""
        if not self._local or not len(mv):
            return None
        self._expected = _Span(address(mv), len(mv))
        return self._expected

    def took(self, span: _Span | None) -> bool:
        """Whether the announced tensor's bytes went through in one piece, their digest then
        coming in ``span.done``; if not, the caller hashes them itself."""
        self._expected = None
        return span is not None and span.start >= 0


class _Span:
    """A tensor's bytes: at ``addr`` in memory as Arrow hands them over (``n`` of them), and
    at ``[start, end)`` in the file once seen there; ``done`` gets their hex digest."""

    __slots__ = ("addr", "n", "start", "end", "hash", "done")

    def __init__(self, addr: int, n: int) -> None:
        self.addr, self.n, self.start, self.end = addr, n, -1, -1
        self.hash = xxhash.xxh3_64()
        self.done: Future[str] = Future()


def _hash_pass(
    file_hash: Any,
    view: memoryview,
    base: int,
    spans: list[_Span],
    pace: Callable[[], None] = _unpaced,
) -> None:
    """Hash ``view`` (the file's bytes from offset ``base``) into the file's hash and, a piece
    at a time while the piece is in the cache, into the tensors' in it; hand over the digests
    of the tensors that end in it. Runs on the sink's one hasher thread, in file order;
    ``pace()`` is called before each piece."""
    try:
        end = base + len(view)
        for lo in range(0, len(view), HASH_PIECE):
            pace()
            piece = view[lo : lo + HASH_PIECE]
            file_hash.update(piece)
            a, b = base + lo, base + lo + len(piece)
            for s in spans:
                x, y = max(a, s.start), min(b, s.end)
                if x < y:
                    s.hash.update(view[x - base : y - base])
    except BaseException as e:
        for s in spans:
            if not s.done.done():
                s.done.set_exception(e)
        raise
    for s in spans:
        if s.end <= end:
            s.done.set_result(s.hash.hexdigest())


def _fail_spans(spans: list[_Span]) -> None:
    for s in spans:  # announced but never reached: the write failed before them
        if not s.done.done():
            s.done.set_exception(RuntimeError("the shard's write stopped before this tensor"))


class _StagedFile:
    """A local file written from ``NBUF`` aligned staging buffers: one fills while the others
    are hashed (in file order, on the sink's helper thread) and written (side by side, each at
    its own offset: a fast device wants several writes in flight)."""

    def __init__(
        self, path: str, hash_: Any, hasher: ThreadPoolExecutor, pace: Callable[[], None]
    ) -> None:
        self.hash, self.hasher, self.pace = hash_, hasher, pace
        self.direct = DIRECT
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self.fd: int | None = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as e:
            if not self.direct or e.errno != errno.EINVAL:
                raise
            self.direct = False
            self.fd = os.open(path, flags, 0o644)
        self.writers = ThreadPoolExecutor(NBUF, thread_name_prefix="ckpt-write")
        self._flip = threading.Lock()
        self._buffers()

    def _buffers(self) -> None:
        self.bufs = [mmap.mmap(-1, STAGE) for _ in range(NBUF)]  # page-aligned
        self.views = [memoryview(b) for b in self.bufs]
        self.pending: list[list[Future[None]]] = [[] for _ in range(NBUF)]
        self.cur, self.fill, self.offset = 0, 0, 0
        self.spans: list[_Span] = []  # tensors seen, not yet wholly handed to the hasher

    def write(self, mv: memoryview) -> None:
        while len(mv):
            take = min(len(mv), STAGE - self.fill)
            self.views[self.cur][self.fill : self.fill + take] = mv[:take]
            self.fill += take
            mv = mv[take:]
            if self.fill == STAGE:
                self._hand_off()

    def _hand_off(self) -> None:
        """Queue the current buffer for hashing and writing; go on in the next one."""
        i, n = self.cur, self.fill
        view = self.views[i]
        self.pending[i] = [
            self.hasher.submit(
                _hash_pass, self.hash, view[:n], self.offset, self._take(n), self.pace
            ),
            self.writers.submit(self._out, view, n, self.offset),
        ]
        self.offset += n
        self.cur, self.fill = (i + 1) % NBUF, 0
        self._wait(self.cur)  # its earlier hashing and writing must be done before a refill

    def _take(self, n: int) -> list[_Span]:
        """The tensors with bytes in the next ``n`` bytes handed off (from ``self.offset``)."""
        a, b = self.offset, self.offset + n
        spans = [s for s in self.spans if s.start < b and s.end > a]
        self.spans = [s for s in self.spans if s.end > b]
        return spans

    def _wait(self, i: int) -> None:
        futs, self.pending[i] = self.pending[i], []
        for f in futs:
            f.result()

    def _out(self, view: memoryview, n: int, offset: int) -> None:
        """Write ``view[:n]`` at ``offset`` (``view`` reaches at least to the next block end)."""
        self.pace()
        length = -(-n // BLOCK) * BLOCK if self.direct else n
        if length > n:  # the tail: whole blocks for O_DIRECT, zero padded, cut off by finish
            view[n:length] = bytes(length - n)
        done = 0
        while done < length:
            try:
                done += os.pwrite(self.fd, view[done:length], offset + done)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                # the filesystem took O_DIRECT at open but refuses it now: write through the
                # page cache from here on (the padding, if any, is cut off by finish)
                with self._flip:
                    flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
                    fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
                    self.direct = False
        if not self.direct:
            storage.start_writeback(self.fd, offset, length)

    def finish(self, size: int) -> None:
        if self.fill:
            self._hand_off()
        for i in range(NBUF):
            self._wait(i)
        if os.fstat(self.fd).st_size != size:
            os.ftruncate(self.fd, size)  # drop the O_DIRECT padding of the last block
        os.fsync(self.fd)

    def release(self) -> None:
        for futs in self.pending:  # let work in flight finish before the buffers go
            for f in futs:
                f.exception()
        self.pending = [[] for _ in range(NBUF)]
        _fail_spans(self.spans)
        self.spans = []
        self.writers.shutdown(wait=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        for v in self.views:
            v.release()
        for b in self.bufs:
            b.close()
        self.views, self.bufs = [], []


class _ImageFile(_StagedFile):
    """A local file written straight from a shard image: Arrow's writes of tensor bytes that
    already sit at their file offset in the image cost nothing; the small pieces in between
    (Arrow's framing and metadata) are copied to their places. Every ``STAGE`` bytes placed
    are hashed (in order) and queued for writing, up to ``NBUF`` writes side by side. Neither
    waits for the other: the image holds the whole file."""

    def __init__(
        self,
        path: str,
        hash_: Any,
        hasher: ThreadPoolExecutor,
        pace: Callable[[], None],
        image: mmap.mmap,
    ) -> None:
        self.image = image
        super().__init__(path, hash_, hasher, pace)

    def _buffers(self) -> None:
        self.view = memoryview(self.image)
        self.base = address(self.view)
        self.placed = self.sent = self.offset = 0
        self.inflight: list[Future[None]] = []
        self.spans = []
        self.bufs, self.views, self.pending = [], [], []

    def write(self, mv: memoryview) -> None:
        n = len(mv)
        if not n:
            return
        end = self.placed + n
        if end > len(self.view):
            raise ValueError(
                f"shard image of {len(self.view)} bytes is too small: it was laid out "
                "for other tensors"
            )
        src = address(mv)
        if src != self.base + self.placed:
            if self.base <= src < self.base + len(self.view):
                raise ValueError(
                    "a tensor in the shard image is not at its file offset: the "
                    "image was laid out for other tensors"
                )
            self.view[self.placed : end] = mv
        self.placed = end
        while self.placed - self.sent >= STAGE:
            self._send(self.sent + STAGE)

    def _send(self, upto: int) -> None:
        a = self.sent
        self.offset = a
        spans = self._take(upto - a)
        self.inflight.append(
            self.hasher.submit(_hash_pass, self.hash, self.view[a:upto], a, spans, self.pace)
        )
        self.inflight.append(self.writers.submit(self._out, self.view[a:], upto - a, a))
        self.sent = upto
        while self.inflight and self.inflight[0].done():  # a failure shows as soon as it can
            self.inflight.pop(0).result()

    def finish(self, size: int) -> None:
        if self.placed > self.sent:
            self._send(self.placed)
        while self.inflight:
            self.inflight.pop(0).result()
        if os.fstat(self.fd).st_size != size:
            os.ftruncate(self.fd, size)
        os.fsync(self.fd)

    def release(self) -> None:
        for f in self.inflight:
            f.exception()
        self.inflight = []
        _fail_spans(self.spans)
        self.spans = []
        self.writers.shutdown(wait=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.view.release()  # the image itself belongs to the caller
