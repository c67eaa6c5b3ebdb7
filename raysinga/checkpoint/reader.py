"""Reading a checkpoint: validate, then map tensors zero-copy.

Opening checks, in order: the manifest's own checksum and structure (how slices tile each
tensor included), the format version, every listed file's size (always) and checksum (unless
``verify="fast"``), then every shard's record batches against the manifest: what they would
decompress to before Arrow decompresses them, then their contents. Any failure is a
:class:`CheckpointError` naming the file.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import xxhash

from . import filehash, storage
from .format import MANIFEST, CheckpointError, TensorInfo
from .ipc_limits import decompressed_limit, decompressed_sizes
from .manifest import MAX_MANIFEST, to_info, unseal
from .storage import Location
from .writer import SCHEMA

VERIFY = ("full", "fast")


def _fail(loc: Location, why: str) -> CheckpointError:
    return CheckpointError(f"{loc}: {why}")


class Checkpoint:
    """A validated checkpoint; tensors are read-only views of the mapped shard files."""

    def __init__(
        self, loc: Location, manifest: dict[str, Any], arrays: dict[tuple[str, int], np.ndarray]
    ) -> None:
        self.location, self.manifest = loc, manifest
        self.infos = [to_info(t) for t in manifest["tensors"]]
        self._arrays = arrays

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest["meta"]

    @classmethod
    def open(cls, where: str | Location, verify: str = "full", fs: Any = None) -> Checkpoint:
        if verify not in VERIFY:
            raise ValueError(f"verify must be one of {VERIFY}, got {verify!r}")
        loc = storage.resolve(where, fs)
        mloc = loc.join(MANIFEST)
        if not storage.is_dir(loc):
            raise _fail(loc, "no such checkpoint directory")
        msize = storage.size(mloc)
        if msize is None:
            raise _fail(loc, f"not a checkpoint: it has no {MANIFEST}")
        if msize > MAX_MANIFEST:
            raise _fail(mloc, f"too large for a manifest ({msize} bytes)")
        m = unseal(mloc, storage.read_bytes(mloc))
        for f in m["files"]:
            floc = loc.join(f["file"])
            got = storage.size(floc)
            if got is None:
                raise _fail(floc, "missing")
            if got != f["size"]:
                raise _fail(
                    floc, f"size {got} bytes, manifest says {f['size']} (truncated or overwritten)"
                )
        if verify == "full":  # shards hashed side by side: xxhash lets go of the GIL
            side = min(4, len(m["files"]) or 1)
            big = sum(f["size"] >= filehash.READ_AHEAD_MIN for f in m["files"])
            readers = max(1, 4 // min(side, max(1, big)))  # about 4 reads in flight in all
            with ThreadPoolExecutor(side) as pool:
                digests = pool.map(
                    filehash.hash_file, [loc.join(f["file"]) for f in m["files"]], repeat(readers)
                )
                for f, digest in zip(m["files"], digests, strict=True):
                    if digest != f["xxh3"]:
                        raise _fail(loc.join(f["file"]), "checksum mismatch: the file is corrupt")
        arrays: dict[tuple[str, int], np.ndarray] = {}
        expect = _by_shard(m)
        for f in m["files"]:
            if f["file"].startswith("shard-"):
                arrays.update(_read_shard(loc.join(f["file"]), expect.get(f["file"], {})))
        _check_found(loc, m, arrays)
        return cls(loc, m, arrays)

    @classmethod
    def from_buffers(cls, files: dict[str, Any], label: str, verify: str = "fast") -> Checkpoint:
        """A checkpoint from its files' bytes in memory (an object-store copy), with the same
        checks as :meth:`open`; tensors are views of those bytes."""
        if verify not in VERIFY:
            raise ValueError(f"verify must be one of {VERIFY}, got {verify!r}")
        loc = Location(pafs.LocalFileSystem(), label)
        if MANIFEST not in files:
            raise _fail(loc, f"not a checkpoint: it has no {MANIFEST}")
        m = unseal(loc.join(MANIFEST), bytes(files[MANIFEST]))
        for f in m["files"]:
            floc, data = loc.join(f["file"]), files.get(f["file"])
            if data is None:
                raise _fail(floc, "missing")
            if len(data) != f["size"]:
                raise _fail(floc, f"size {len(data)} bytes, manifest says {f['size']}")
        if verify == "full":  # side by side, as open() does: xxhash lets go of the GIL
            with ThreadPoolExecutor(min(4, len(m["files"]) or 1)) as pool:
                data = [files[f["file"]] for f in m["files"]]
                digests = pool.map(xxhash.xxh3_64_hexdigest, data)
                for f, digest in zip(m["files"], digests, strict=True):
                    if digest != f["xxh3"]:
                        raise _fail(loc.join(f["file"]), "checksum mismatch: the file is corrupt")
        arrays: dict[tuple[str, int], np.ndarray] = {}
        expect = _by_shard(m)
        for f in m["files"]:
            if f["file"].startswith("shard-"):
                buf = pa.py_buffer(files[f["file"]])
                arrays.update(_read_shard(loc.join(f["file"]), expect.get(f["file"], {}), buf))
        _check_found(loc, m, arrays)
        return cls(loc, m, arrays)

    def names(self, kind: str | None = None) -> list[str]:
        seen: dict[str, None] = {}
        for i in self.infos:
            if kind is None or i.kind == kind:
                seen[i.name] = None
        return list(seen)

    def info(self, name: str) -> TensorInfo:
        for i in self.infos:
            if i.name == name:
                return i
        raise KeyError(f"no tensor {name!r} in {self.location}")

    def slices(self, name: str) -> list[tuple[TensorInfo, np.ndarray]]:
        out = sorted(
            ((i, self._arrays[(i.name, i.start)]) for i in self.infos if i.name == name),
            key=lambda p: p[0].start,
        )
        if not out:
            raise KeyError(f"no tensor {name!r} in {self.location}")
        return out

    def array(self, name: str) -> np.ndarray:
        """The whole tensor: a zero-copy view when stored in one piece, else assembled."""
        pieces = self.slices(name)  # they tile it: checked at open
        first = pieces[0][0]
        if len(pieces) == 1:
            return pieces[0][1].reshape(first.shape)
        return np.concatenate([a for _, a in pieces]).reshape(first.shape)

    def flat_range(self, name: str, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of the flattened tensor, from however it was sliced when
        saved: how a server of a different topology loads just its own slice (resharding)."""
        pieces = self.slices(name)
        size = pieces[0][0].size
        if not 0 <= start <= stop <= size:
            raise ValueError(f"range [{start}, {stop}) outside tensor {name!r} of {size} elements")
        for info, a in pieces:  # one stored piece covers it: a zero-copy view
            if info.start <= start and stop <= info.stop:
                return a[start - info.start : stop - info.start]
        out = np.empty(stop - start, np.dtype(pieces[0][0].dtype))
        for info, a in pieces:  # they tile the tensor (checked at open): every element once
            lo, hi = max(start, info.start), min(stop, info.stop)
            if lo < hi:
                out[lo - start : hi - start] = a[lo - info.start : hi - info.start]
        return out

    def verify_tensors(self) -> int:
        """Check every tensor slice against its own checksum (the ``params.meta`` column);
        returns the number of bytes hashed."""
        total = 0
        for t in self.manifest["tensors"]:
            a = self._arrays[(t["name"], t["start"])]
            if not isinstance(t.get("xxh3"), str):  # optional at open: only this check needs it
                raise _fail(
                    self.location.join(MANIFEST),
                    f"tensor {t['name']!r} [{t['start']}, {t['stop']}) has no checksum",
                )
            if xxhash.xxh3_64_hexdigest(memoryview(a.reshape(-1).view(np.uint8))) != t["xxh3"]:
                raise _fail(
                    self.location.join(f"shard-{t['shard']}.arrow"),
                    f"checksum mismatch in tensor {t['name']!r}",
                )
            total += a.nbytes
        return total

    def arrays(self, kind: str | None = "param") -> dict[str, np.ndarray]:
        return {n: self.array(n) for n in self.names(kind)}


def _by_shard(m: dict[str, Any]) -> dict[str, dict[tuple[str, int], TensorInfo]]:
    """The manifest's slices by the shard file that must hold them."""
    out: dict[str, dict[tuple[str, int], TensorInfo]] = {}
    for t in m["tensors"]:
        out.setdefault(f"shard-{t['shard']}.arrow", {})[(t["name"], t["start"])] = to_info(t)
    return out


def _check_found(loc: Location, m: dict[str, Any], arrays: dict[tuple[str, int], Any]) -> None:
    missing = {(t["name"], t["start"]) for t in m["tensors"]} - set(arrays)
    if missing:
        raise _fail(
            loc,
            f"tensor slices listed in the manifest are absent from the shards: "
            f"{sorted(missing)[:5]}",
        )


def _read_shard(
    loc: Location, expect: dict[tuple[str, int], TensorInfo], buf: Any = None
) -> dict[tuple[str, int], np.ndarray]:
    """The slices ``expect`` names, read from the shard at ``loc`` (or from its bytes ``buf``);
    they must be exactly the shard's records."""
    try:
        if buf is None and loc.local:  # a view of the mapped file: tensors point into the map
            buf = pa.memory_map(loc.path, "r").read_buffer()
        elif buf is None:
            with loc.fs.open_input_file(loc.path) as f:
                buf = f.read_buffer()
        sizes = decompressed_sizes(buf)
        if len(sizes) != len(expect):
            raise ValueError(f"{len(sizes)} records, the manifest lists {len(expect)}")
        allowed = sum(decompressed_limit(i) for i in expect.values())
        if sum(sizes) > allowed:  # Arrow would allocate it all before any other check
            raise _fail(
                loc,
                f"its records would decompress to {sum(sizes)} bytes, more than the manifest "
                f"allows for its {len(expect)} tensor slices ({allowed} bytes)",
            )
        reader = pa.ipc.open_file(pa.BufferReader(buf))
        if not reader.schema.equals(SCHEMA):
            raise ValueError("unexpected schema")
        out = {}
        for i in range(reader.num_record_batches):
            b = reader.get_batch(i)
            if b.num_rows != 1 or not b.schema.equals(SCHEMA):
                raise ValueError("unexpected record batch layout")
            # Arrow trusts offsets and lengths it reads; a corrupt shard that passed a size-only
            # check (verify="fast") must not reach them unchecked (it can crash the process).
            b.validate(full=True)
            row = {k: b.column(k)[0].as_py() for k in b.schema.names[:-1]}
            info = expect.get((row["name"], row["start"]))
            if info is None or [
                row["kind"],
                row["stop"],
                tuple(row["shape"]),
                row["dtype"],
                row["version"],
            ] != [info.kind, info.stop, info.shape, info.dtype, info.version]:
                raise ValueError(f"record {row['name']!r} disagrees with the manifest")
            buf = b.column("data").buffers()[2]
            if buf is None:
                buf = pa.py_buffer(b"")
            offsets = np.frombuffer(
                b.column("data").buffers()[1], np.int64, 2, b.column("data").offset * 8
            )
            n = int(offsets[1] - offsets[0])
            if n != info.nbytes:
                raise ValueError(f"record {info.name!r} holds {n} bytes, expected {info.nbytes}")
            out[(info.name, info.start)] = np.frombuffer(
                buf, np.dtype(info.dtype), info.stop - info.start, int(offsets[0])
            )
        return out
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed shard, whatever Arrow says about it
        raise _fail(loc, f"unreadable shard ({type(e).__name__}: {str(e)[:200]})") from None
