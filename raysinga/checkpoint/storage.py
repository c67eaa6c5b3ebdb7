"""Where checkpoints live: local paths and any pyarrow filesystem URI, through one code path.

Local files get what a crash-safe commit needs and object stores cannot give: fsync of files and
directories, and an atomic rename of the finished directory. On other filesystems the manifest is
written last, so a directory without a valid manifest is never taken for a checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import xxhash

from .format import MANIFEST, STEP_DIR, CheckpointError


@dataclass(frozen=True)
class Location:
    fs: pafs.FileSystem
    path: str  # a path within ``fs``

    @property
    def local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def join(self, *parts: str) -> Location:
        return Location(self.fs, "/".join([self.path.rstrip("/"), *parts]))

    def __str__(self) -> str:
        return self.path if self.local else f"{self.fs.type_name}://{self.path}"


def resolve(where: str | os.PathLike | Location, fs: pafs.FileSystem | None = None) -> Location:
    """A Location from a local path, a URI (``file://``, ``s3://``, ``gs://``, ``hdfs://``) or
    a path within an explicit filesystem."""
    if isinstance(where, Location):
        return where
    where = os.fspath(where)
    if fs is not None:
        return Location(fs, where)
    if "://" in where:
        try:
            f, path = pafs.FileSystem.from_uri(where)
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{where}: cannot open this location: {e}") from None
        return Location(f, path)
    return Location(pafs.LocalFileSystem(), os.path.abspath(where))


def exists(loc: Location) -> bool:
    return loc.fs.get_file_info(loc.path).type != pafs.FileType.NotFound


def is_dir(loc: Location) -> bool:
    return loc.fs.get_file_info(loc.path).type == pafs.FileType.Directory


def size(loc: Location) -> int | None:
    info = loc.fs.get_file_info(loc.path)
    return info.size if info.type == pafs.FileType.File else None


def list_dirs(loc: Location) -> list[str]:
    if not is_dir(loc):
        return []
    sel = pafs.FileSelector(loc.path, recursive=False)
    return [i.base_name for i in loc.fs.get_file_info(sel) if i.type == pafs.FileType.Directory]


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


READ_PIECE = 32 << 20  # what one read-ahead thread asks of the device at a time
READ_AHEAD_MIN = 2 * READ_PIECE  # smaller files are read by the hasher alone


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


def _load_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + length)`` of ``fd`` to the device now,
    without waiting (a hint: errors surface at the ``fsync`` that follows)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def write_bytes(loc: Location, data: bytes) -> None:
    with loc.fs.open_output_stream(loc.path) as f:
        f.write(data)
    if loc.local:
        fsync_path(loc.path)


def read_bytes(loc: Location, limit: int | None = None) -> bytes:
    with loc.fs.open_input_stream(loc.path) as f:
        return f.read(limit) if limit is not None else f.read()


def staging_dir(root: Location, name: str, tag: str, replace: bool = False) -> Location:
    """Where the checkpoint directory ``name`` is written before its commit.

    Local, or to replace a committed checkpoint: a ``<name>.tmp-<tag>`` sibling, put in place by
    :func:`commit_dir`. Elsewhere (object stores have no directory rename; S3 ``move`` copies
    single objects only): ``name`` itself, written in place with the manifest last, which is the
    commit. A directory of that name without a manifest is what an interrupted writer left: it
    is removed here; one with a manifest is a checkpoint and is overwritten only by a replace.
    """
    if root.local or replace:
        return root.join(f"{name}.tmp-{tag}")
    final = root.join(name)
    if exists(final):
        if exists(final.join(MANIFEST)):
            raise CheckpointError(f"{final}: already exists; a checkpoint is never overwritten")
        remove_dir(final)
    return final


def remove_unfinished(loc: Location) -> bool:
    """Remove the checkpoint directory ``loc`` if it has no manifest (an interrupted in-place
    write on an object store, see :func:`staging_dir`); True if it was removed."""
    if exists(loc.join(MANIFEST)):
        return False
    remove_dir(loc)
    return True


def commit_dir(tmp: Location, final: Location, replace: bool = False) -> None:
    """Make ``tmp`` appear as ``final``. Written in place (object stores, see
    :func:`staging_dir`), the manifest already written last was the commit.

    A committed ``final`` is refused unless ``replace``. Local: a rename (an atomic exchange
    when replacing) and directory fsyncs. Object stores: the staged objects are copied into
    ``final``, whose manifest is deleted first and copied last (:func:`_copy_in`)."""
    if not tmp.local and tmp.path == final.path:
        return
    if not replace and exists(final if tmp.local else final.join(MANIFEST)):
        raise CheckpointError(f"{final}: already exists; a checkpoint is never overwritten")
    if not tmp.local:
        _copy_in(tmp, final)
        return
    fsync_path(tmp.path, directory=True)
    if replace and exists(final):
        _swap_local(tmp, final)
    else:
        os.rename(tmp.path, final.path)
        fsync_path(os.path.dirname(final.path), directory=True)


def _swap_local(tmp: Location, final: Location) -> None:
    """Put ``tmp`` in the place of the directory ``final`` and delete the old one. Without an
    atomic exchange, two renames: a crash between them leaves the old one under
    :func:`replaced_name` and no ``final``, which :func:`manage.recover` renames back."""
    parent = os.path.dirname(final.path)
    if exchange(tmp.path, final.path):
        fsync_path(parent, directory=True)
        old = tmp  # the old checkpoint, now under the temporary name
    else:
        old = replaced_name(tmp, final)
        os.rename(final.path, old.path)
        fsync_path(parent, directory=True)
        try:
            os.rename(tmp.path, final.path)
        except OSError:
            os.rename(old.path, final.path)
            raise
        fsync_path(parent, directory=True)
    with contextlib.suppress(OSError):  # committed: a leftover is removed later (manage)
        remove_dir(old)


def replaced_name(tmp: Location, final: Location) -> Location:
    """Where a local replace puts the old ``final`` between its two renames:
    ``<final>.replaced-<tag of tmp>``."""
    return Location(final.fs, f"{final.path}.replaced-{tmp.path.rsplit('.tmp-', 1)[-1]}")


RENAME_EXCHANGE = 2  # renameat2 flag, <linux/fs.h>
_AT_FDCWD = -100


def _load_renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _load_renameat2()


def exchange(a: str, b: str) -> bool:
    """Swap two local paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``): no moment
    exists at which either is missing. False where the C library, the kernel or the
    filesystem cannot (the caller falls back to two renames)."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def _copy_in(tmp: Location, final: Location) -> None:
    """Object stores: replace ``final`` by a copy of the staged ``tmp``. Until the copy of the
    manifest lands, ``final`` is no checkpoint but ``tmp`` is a whole one, which
    :func:`manage.recover` copies in again after a crash."""
    remove_dir(final)
    copy_dir(tmp, final)
    with contextlib.suppress(OSError):  # committed: a leftover is removed later (manage)
        remove_dir(tmp)


def move_dir(src: Location, dst: Location) -> None:
    """Move the directory ``src`` to ``dst``, which must not exist. Local: one rename. Object
    stores have no directory rename: each object is copied (manifest last), then ``src`` is
    deleted (manifest first), so a crash leaves at worst two copies, never a manifest over
    missing files."""
    if exists(dst):
        raise CheckpointError(f"{dst}: already exists")
    if src.local:
        os.rename(src.path, dst.path)
        fsync_path(os.path.dirname(dst.path), directory=True)
        return
    copy_dir(src, dst)
    remove_dir(src)


COPY_OBJECT_MAX = 5 << 30  # S3's CopyObject refuses larger sources; they stream through here
_COPY_PIECE = 64 << 20


def copy_dir(src: Location, dst: Location) -> None:
    """Copy every file under ``src`` to the same name under ``dst``, server-side where the
    store can, with ``src``'s manifest last: ``dst`` becomes a checkpoint only once whole."""
    top = src.path.rstrip("/")
    files = [
        i
        for i in src.fs.get_file_info(pafs.FileSelector(top, recursive=True))
        if i.type == pafs.FileType.File
    ]
    files.sort(key=lambda i: i.path == f"{top}/{MANIFEST}")
    dst.fs.create_dir(dst.path, recursive=True)
    for i in files:
        target = dst.join(i.path[len(top) + 1 :])
        if i.size is not None and i.size > COPY_OBJECT_MAX:
            with src.fs.open_input_stream(i.path) as f, dst.fs.open_output_stream(target.path) as g:
                while piece := f.read(_COPY_PIECE):
                    g.write(piece)
        else:
            src.fs.copy_file(i.path, target.path)


def remove_dir(loc: Location) -> None:
    """Delete a directory. On object stores, where a delete is many requests, the manifest
    goes first, so that one cut short leaves an unfinished directory, not a checkpoint with
    files missing. A staged replacement that is its step's only whole copy (the step's own
    directory uncommitted mid-replace) is kept: :func:`manage.recover` needs it."""
    if not exists(loc):
        return
    if not loc.local:
        if _only_copy(loc):
            return
        if exists(loc.join(MANIFEST)):
            loc.fs.delete_file(loc.join(MANIFEST).path)
    loc.fs.delete_dir(loc.path)


def _only_copy(loc: Location) -> bool:
    """Whether ``loc`` is a whole ``step-N.tmp-<id>`` and ``step-N`` has no manifest."""
    base, sep, _ = loc.path.rstrip("/").rpartition(".tmp-")
    if not sep or not STEP_DIR.match(base.rsplit("/", 1)[-1]):
        return False
    return exists(loc.join(MANIFEST)) and not exists(Location(loc.fs, base).join(MANIFEST))


class RunLock:
    """One writer per run directory: ``.writer.lock`` holds the writer's host and pid.

    On a local filesystem a lock left by a dead process of this host is taken over; elsewhere a
    stale lock must be removed by hand (the error says which file).
    """

    def __init__(self, root: Location) -> None:
        self.root, self.file = root, root.join(".writer.lock")
        self.owner = f"{socket.gethostname()} {os.getpid()}"
        self.held = False

    def acquire(self) -> RunLock:
        self.root.fs.create_dir(self.root.path, recursive=True)
        if self.root.local:
            self._acquire_local()
        else:
            if exists(self.file):
                raise CheckpointError(self._busy(read_bytes(self.file).decode(errors="replace")))
            write_bytes(self.file, self.owner.encode())
        self.held = True
        return self

    def _acquire_local(self) -> None:
        # Check-and-create under an flock of the run directory itself: the kernel drops it when
        # its holder dies, so it is never stale, and two writers taking over one dead lock
        # cannot both win. The lock file appears whole (rename), so a writer killed while
        # taking it never leaves an empty one behind.
        guard = os.open(self.root.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            for name in os.listdir(self.root.path):  # left by writers killed mid-acquire
                if name.startswith(".writer.lock.tmp-"):
                    os.unlink(os.path.join(self.root.path, name))
            try:
                holder = open(self.file.path).read().strip()
            except FileNotFoundError:
                holder = None
            if holder is not None:
                host, _, pid = holder.partition(" ")
                if not (host == socket.gethostname() and pid.isdigit() and not _alive(int(pid))):
                    raise CheckpointError(self._busy(holder))
                # else: its writer died without letting go; the rename below replaces it
            tmp = f"{self.file.path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(self.owner)
            os.rename(tmp, self.file.path)
        finally:
            os.close(guard)  # also releases the flock

    def _busy(self, holder: str) -> str:
        return (
            f"{self.root}: another writer holds this run directory ({holder}); if it is "
            f"gone, remove {self.file}"
        )

    def release(self) -> None:
        if self.held and exists(self.file):
            self.root.fs.delete_file(self.file.path)
        self.held = False

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
