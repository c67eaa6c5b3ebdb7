"""Where checkpoints live: local paths and any pyarrow filesystem URI, through one code path.

The basic operations every other module builds on: resolve a location, look at it, read and
write whole small files (fsynced locally), and delete a checkpoint directory so that one cut
short is never taken for a checkpoint. Putting a directory in place (commit, replace, move,
copy) is :mod:`.placement`; hashing files is :mod:`.filehash`; the run's writer lock is
:mod:`.lock`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

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
            raise CheckpointError(redact_text(f"{where}: cannot open this location: {e}")) from None
        return Location(f, path)
    return Location(pafs.LocalFileSystem(), os.path.abspath(where))


# query parameters of a storage URI that carry a credential (pyarrow's and the usual clouds')
SECRET_PARAMS = frozenset(
    {
        "access_key",
        "secret_key",
        "session_token",
        "password",
        "token",
        "credential",
        "credentials",
        "sig",
        "signature",
        "x-amz-credential",
        "x-amz-signature",
        "x-amz-security-token",
        "sas_token",
        "account_key",
    }
)


def redact(uri: str) -> str:
    """``uri`` without credentials: no user info (``s3://KEY:SECRET@bucket``), and the value
    of every query parameter that carries one replaced by ``***``. Anything not a URI is
    returned as it is."""
    scheme, sep, rest = uri.partition("://")
    if not sep or not scheme.replace("+", "").replace("-", "").replace(".", "").isalnum():
        return uri
    rest, qsep, query = rest.partition("?")
    authority, slash, path = rest.partition("/")
    authority = authority.rpartition("@")[2]
    if qsep:
        parts = []
        for item in query.split("&"):
            name, eq, _ = item.partition("=")
            parts.append(f"{name}=***" if eq and name.lower() in SECRET_PARAMS else item)
        query = "&".join(parts)
    return f"{scheme}://{authority}{slash}{path}{qsep}{query}"


_URI = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+")


def redact_text(text: str) -> str:
    """``text`` (an error message, a log line) with every URI in it :func:`redact`-ed."""
    return _URI.sub(lambda m: redact(m.group(0)), text)


def redact_all(value: Any) -> Any:
    """``value`` (nested dicts, lists, strings) with every URI string :func:`redact`-ed."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_all(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_all(v) for v in value)
    return value


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


def replace_bytes(loc: Location, data: bytes) -> None:
    """Write ``data`` as ``loc`` whole: a reader sees the older content or the new, never a
    part (locally written aside, then renamed over it; an object store's put is whole)."""
    if not loc.local:
        write_bytes(loc, data)
        return
    tmp = Location(loc.fs, f"{loc.path}.tmp-{os.getpid()}")
    try:
        write_bytes(tmp, data)
        os.replace(tmp.path, loc.path)
    except BaseException:  # a full disk, say: nothing is left beside the older content
        with contextlib.suppress(OSError):
            os.unlink(tmp.path)
        raise


def read_bytes(loc: Location, limit: int | None = None) -> bytes:
    with loc.fs.open_input_stream(loc.path) as f:
        return f.read(limit) if limit is not None else f.read()


def remove_unfinished(loc: Location) -> bool:
    """Remove the checkpoint directory ``loc`` if it has no manifest (an interrupted in-place
    write on an object store, see :func:`.placement.staging_dir`); True if it was removed."""
    if exists(loc.join(MANIFEST)):
        return False
    remove_dir(loc)
    return True


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
