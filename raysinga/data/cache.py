"""A bounded on-disk cache of fixed-size blocks of remote files, shared by the processes of a node.

A block is one file, ``<key>-<index>.blk``, in one flat directory: written under a temporary name
and renamed into place, so a reader sees a whole block or none. Its modification time is its last
use; when the directory would grow past its byte bound the least recently used blocks go first.
Nothing locks: another process may evict a block between our listing and our read, which reads
as a miss and is fetched again. A block whose length is not the expected one (a crash before the
data reached the disk) is a miss too.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import DataError

MiB = 2**20
DEFAULT_BLOCK_BYTES = 4 * MiB
DEFAULT_CACHE_BYTES = 4096 * MiB
MIN_BLOCK_BYTES = 4096
MAX_BLOCK_BYTES = 1024 * MiB
STALE_TMP_S = 3600  # a temporary block this old was left by a process that died mid-write


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/raysinga/data``, else ``~/.cache/raysinga/data``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "raysinga", "data")


@dataclass(frozen=True)
class CacheSpec:
    """Where and how much a node caches of remote data files (``cache_dir``, ``cache_bytes``,
    ``block_bytes`` of ``data.source``). ``directory`` None is :func:`default_cache_dir`,
    resolved on the node that reads, not on the driver."""

    directory: str | None = None
    max_bytes: int = DEFAULT_CACHE_BYTES
    block_bytes: int = DEFAULT_BLOCK_BYTES

    def __post_init__(self) -> None:
        d = self.directory
        if d is not None and (not isinstance(d, str) or not d):
            raise ValueError(f"cache_dir must be a non-empty path, got {self.directory!r}")
        for name, v in (("cache_bytes", self.max_bytes), ("block_bytes", self.block_bytes)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer number of bytes, got {v!r}")
        if not MIN_BLOCK_BYTES <= self.block_bytes <= MAX_BLOCK_BYTES:
            raise ValueError(
                f"block_bytes must lie in [{MIN_BLOCK_BYTES}, {MAX_BLOCK_BYTES}], "
                f"got {self.block_bytes}"
            )
        if self.max_bytes < self.block_bytes:
            raise ValueError(
                f"cache_bytes ({self.max_bytes}) must hold at least one block "
                f"(block_bytes = {self.block_bytes})"
            )


class BlockCache:
    """The blocks in ``spec.directory``, at most ``spec.max_bytes`` of them in all."""

    def __init__(self, spec: CacheSpec) -> None:
        self.directory = spec.directory or default_cache_dir()
        self.max_bytes = spec.max_bytes
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, f".probe-{os.getpid()}-{secrets.token_hex(4)}")
            with open(probe, "wb"):
                pass
            os.remove(probe)
        except OSError as e:
            raise DataError(
                f"cannot be written ({e.strerror or e}); set cache_dir of data.source to a "
                "writable directory",
                file=self.directory,
                key="cache_dir",
            ) from None

    def get(self, name: str, length: int, fetch: Callable[[], bytes]) -> bytes:
        """Block ``name`` of ``length`` bytes: from disk when there, else ``fetch()``-ed and
        stored. A block that cannot be stored (a full disk) is still returned."""
        path = os.path.join(self.directory, name)
        with contextlib.suppress(FileNotFoundError):  # never stored, or evicted meanwhile
            with open(path, "rb") as f:
                data = f.read()
            if len(data) == length:
                with contextlib.suppress(OSError):
                    os.utime(path)  # the LRU order is the files' modification times
                return data
        data = fetch()
        if len(data) != length:
            raise OSError(f"read {len(data)} bytes of a {length}-byte block")
        self._put(path, data)
        return data

    def _put(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            self._evict(room=len(data))
            os.replace(tmp, path)
        except OSError:  # a cache is an optimisation: a full disk only costs refetches
            with contextlib.suppress(OSError):
                os.remove(tmp)

    def usage(self) -> int:
        """The bytes of all whole blocks in the directory."""
        return sum(size for _, _, size in self._blocks())

    def _blocks(self) -> list[tuple[int, str, int]]:
        """(last use, path, size) of every whole block; removes temporary blocks left behind."""
        found, now = [], time.time()
        with os.scandir(self.directory) as it:
            for entry in it:
                try:
                    st = entry.stat()
                except FileNotFoundError:  # evicted by another process meanwhile
                    continue
                if entry.name.endswith(".blk"):
                    found.append((st.st_mtime_ns, entry.path, st.st_size))
                elif ".blk.tmp-" in entry.name and now - st.st_mtime > STALE_TMP_S:
                    with contextlib.suppress(OSError):
                        os.remove(entry.path)
        return found

    def _evict(self, room: int) -> None:
        """Remove least recently used blocks until ``room`` more bytes fit under the bound."""
        blocks = self._blocks()
        total = sum(size for _, _, size in blocks)
        for _, path, size in sorted(blocks):
            if total + room <= self.max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            total -= size
