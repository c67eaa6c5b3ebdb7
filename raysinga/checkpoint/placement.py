"""Putting a checkpoint directory in place, crash-safe: commit, replace, move and copy.

The module is not named ``commit``: the package exports :func:`.writer.commit` under that name.

Local files get what a crash-safe commit needs and object stores cannot give: fsync of files and
directories, an atomic rename of the finished directory, and, to replace a committed one, an
atomic exchange (or two renames that :func:`.manage.recover` can finish). Object stores have no
directory rename: there a checkpoint is written in place or copied object by object, its
manifest always last, so a directory without a valid manifest is never taken for a checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from typing import Any

import pyarrow.fs as pafs

from .format import MANIFEST, CheckpointError
from .storage import Location, exists, fsync_path, remove_dir


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
