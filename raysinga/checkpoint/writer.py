"""Writing a checkpoint: shards (one per server, possibly from different processes), then a commit.

Each shard is written into the temporary directory ``step-N.tmp-<id>`` beside its final place and
hashed as it is written; :func:`commit` writes ``params.meta`` and, last, the manifest with every
file's size and checksum, then renames the directory into place. A crash at any point leaves at
most a ``.tmp-`` directory, which readers ignore and the next writer removes. Object stores have
no directory rename: there the shards go straight into ``step-N`` and the manifest, written last,
is the commit (see :func:`.placement.staging_dir`). Replacing a committed checkpoint is an explicit
choice (``replace=True``), staged in ``step-N.tmp-<id>`` everywhere.
"""

from __future__ import annotations

import contextlib
import mmap
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from . import storage
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    META,
    CheckpointError,
    TensorInfo,
    as_array,
)
from .ipc_compress import MixedWriter
from .manifest import seal
from .placement import commit_dir, staging_dir
from .sink import BLOCK, ShardSink, address
from .storage import Location

SCHEMA = pa.schema(
    [
        ("name", pa.string()),
        ("kind", pa.string()),
        ("start", pa.int64()),
        ("stop", pa.int64()),
        ("shape", pa.list_(pa.int64())),
        ("dtype", pa.string()),
        ("version", pa.int64()),
        ("data", pa.large_binary()),
    ]
)
COMPRESSIONS = (None, "zstd", "lz4")


def _record_batch(info: TensorInfo, arr: Any) -> pa.RecordBatch:
    """One tensor's row of a shard: its description and its bytes. Every column is built from
    buffers: ``pa.array`` of Python values makes pyarrow import pandas, where it is installed,
    to check whether they are pandas objects (half a second of CPU in each server as its first
    checkpoint is written, while it trains)."""
    raw = pa.py_buffer(arr.reshape(-1).view("uint8") if arr.size else b"")
    data = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), 1, [None, _words([0, raw.size], np.int64), raw]
    )
    shape = pa.ListArray.from_buffers(
        pa.list_(pa.int64()), 1, [None, _words([0, len(info.shape)], np.int32)],
        children=[_int64s(list(info.shape))],
    )  # fmt: skip
    columns = [
        _string(info.name),
        _string(info.kind),
        _int64s([info.start]),
        _int64s([info.stop]),
        shape,
        _string(info.dtype),
        _int64s([info.version]),
        data,
    ]
    return pa.record_batch(columns, schema=SCHEMA)


def _words(values: list[int], dtype: Any) -> pa.Buffer:
    return pa.py_buffer(np.asarray(values, dtype))


def _int64s(values: list[int]) -> pa.Array:
    return pa.Array.from_buffers(pa.int64(), len(values), [None, _words(values, np.int64)])


def _string(text: str) -> pa.Array:
    b = text.encode()
    return pa.Array.from_buffers(
        pa.string(), 1, [None, _words([0, len(b)], np.int32), pa.py_buffer(b)]
    )


def begin(root: str | Location, step: int, replace: bool = False) -> Location:
    """Create and return the directory the checkpoint of ``step`` is written into: a temporary
    one on local disk, ``step-<step>`` itself on object stores. ``replace``: the checkpoint
    will replace a committed ``step-<step>`` (commit with ``replace=True`` too), so it is
    staged in a temporary directory everywhere."""
    root = storage.resolve(root)
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative integer, got {step!r}")
    tmp = staging_dir(root, f"step-{step}", uuid.uuid4().hex[:12], replace=replace)
    with _writing(tmp):
        tmp.fs.create_dir(tmp.path, recursive=True)
    return tmp


def write_shard(
    tmp: str | Location,
    shard: int,
    tensors: Iterable[tuple[TensorInfo, Any]],
    compression: str | None = None,
    image: ShardImage | None = None,
    pace: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Write ``shard-<shard>.arrow`` into the temporary directory; returns its record for the
    manifest (file, size, checksum, and one entry per tensor for ``params.meta``).

    Hashing costs a save almost nothing: each tensor and the file's bytes are hashed on helper
    threads while Arrow writes them (see :mod:`.sink`). With ``image`` (the tensors having been
    placed in it by :meth:`ShardImage.place`), a local file is written from it without copying,
    and its tensors are hashed in the file's own pass over it. ``pace()``, if given, is called
    before each piece of the hashing and each write (on local disk): a writer that must leave
    room to other work waits in it.
    """
    if compression not in COMPRESSIONS:
        raise CheckpointError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if image is not None and compression is not None:
        raise ValueError("a shard image holds uncompressed tensors only")
    tmp = storage.resolve(tmp)
    loc = tmp.join(f"shard-{shard}.arrow")
    infos: list[TensorInfo] = []
    hashes: list[Future[str]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") as pool, _writing(loc):
        sink = ShardSink(loc, None if image is None else image.buf, pace)
        try:
            if compression is None:
                w: Any = pa.ipc.new_file(pa.PythonFile(sink, mode="w"), SCHEMA)
            else:  # each record batch compressed only where that makes it smaller
                tensors = list(tensors)
                w = MixedWriter(sink, SCHEMA, compression, len(tensors))
            for info, a in tensors:
                arr = as_array(a)
                info = _checked(info, arr, shard)
                flat = memoryview(arr.reshape(-1).view("uint8"))
                # hashed in the file's pass where Arrow writes the bytes as they are,
                # else here, beside Arrow's write
                span = sink.expect(flat) if compression is None else None
                own = None if span is not None else pool.submit(xxhash.xxh3_64_hexdigest, flat)
                w.write_batch(_record_batch(info, arr))
                infos.append(info)
                if sink.took(span):
                    hashes.append(span.done)
                else:  # the caller may reuse ``a`` once we move on: hashed by then
                    hashes.append(own or pool.submit(xxhash.xxh3_64_hexdigest, flat))
                    hashes[-1].result()
            w.close()
            sink.finish()
        finally:
            sink.release()
        size, digest = sink.size, sink.hexdigest()
    entries = [{**_info_dict(i), "xxh3": h.result()} for i, h in zip(infos, hashes, strict=True)]
    return {
        "file": f"shard-{shard}.arrow",
        "size": size,
        "xxh3": digest,
        "compression": compression,
        "tensors": entries,
    }


class _Layout:
    """A dry run of Arrow's writer: where each tensor's bytes would land in the file (found by
    the address Arrow hands over), and the file's size. No tensor byte is read."""

    def __init__(self, tensors: list[tuple[TensorInfo, np.ndarray]]) -> None:
        self.size, self.closed = 0, False
        self._want = {
            address(memoryview(a.reshape(-1).view("uint8"))): i
            for i, (_, a) in enumerate(tensors)
            if a.size
        }
        self.offsets = [-1] * len(tensors)
        with pa.ipc.new_file(pa.PythonFile(self, mode="w"), SCHEMA) as w:
            for info, a in tensors:
                w.write_batch(_record_batch(info, a))

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        if len(mv) and (i := self._want.get(address(mv))) is not None and self.offsets[i] < 0:
            self.offsets[i] = self.size
        self.size += len(mv)
        return len(mv)

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


class ShardImage:
    """A shard file laid out in memory: one page-aligned region in which each tensor has its
    place at its file offset. Copying tensors into their places (:meth:`place`) is the only
    copy a save then makes; :func:`write_shard` writes the file straight from the region.

    Made once for a set of names, shapes and dtypes and reused (its pages stay mapped, so a
    copy into it costs no page faults), e.g. by a parameter server checkpointing every N steps.
    """

    def __init__(self, tensors: list[tuple[TensorInfo, Any]]) -> None:
        tensors = [(i, as_array(a)) for i, a in tensors]
        self.layout = self._layout(tensors)
        size, offsets = self.layout
        self.nbytes = tuple(a.nbytes for _, a in tensors)
        if any(o < 0 for o, (_, a) in zip(offsets, tensors, strict=True) if a.size):
            raise ValueError("Arrow did not write the tensors' bytes from their own memory")
        self.buf = mmap.mmap(-1, max(BLOCK, -(-size // BLOCK) * BLOCK))
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self.buf.madvise(mmap.MADV_HUGEPAGE)
        np.frombuffer(self.buf, np.uint8)[::4096] = 0  # fault every page in now, not at a save

    @staticmethod
    def _layout(tensors: list[tuple[TensorInfo, np.ndarray]]) -> tuple[int, tuple[int, ...]]:
        lay = _Layout(tensors)
        return lay.size, tuple(lay.offsets)

    def fits(self, tensors: list[tuple[TensorInfo, Any]]) -> bool:
        """Whether ``tensors`` (names, shapes, dtypes, order) have this image's layout."""
        return self._layout([(i, as_array(a)) for i, a in tensors]) == self.layout

    def place(
        self, tensors: list[tuple[TensorInfo, Any]], pool: Any = None
    ) -> list[tuple[TensorInfo, np.ndarray]]:
        """Copy ``tensors`` (which must fit) into their places, in chunks on ``pool`` if given;
        returns them as views of the image, to hand to :func:`write_shard` with this image."""
        out, pairs = [], []
        offsets = self.layout[1]
        if len(tensors) != len(offsets):
            raise ValueError(
                f"the shard image was laid out for {len(offsets)} tensors, not {len(tensors)}"
            )
        for (info, a), off, n in zip(tensors, offsets, self.nbytes, strict=True):
            a = as_array(a)
            if a.nbytes != n:
                raise ValueError(
                    f"tensor {info.name!r} has {a.nbytes} bytes; the shard image was "
                    f"laid out for {n}"
                )
            if not a.size:
                out.append((info, a))
                continue
            dst = np.frombuffer(self.buf, a.dtype, a.size, off).reshape(a.shape)
            pairs.append((dst, a))
            out.append((info, dst))
        copy_in_chunks(pairs, pool)
        return out


COPY_CHUNK = 4 << 20  # bytes per piece of a large copy


def copy_in_chunks(pairs: list[tuple[np.ndarray, np.ndarray]], pool: Any = None) -> None:
    """``dst[...] = src`` for each pair of same-sized arrays, cut into ``COPY_CHUNK`` pieces run
    on ``pool``'s threads (in this thread without one): a large copy is faster on several
    cores."""
    jobs = []
    for dst, src in pairs:
        d, s = dst.reshape(-1), src.reshape(-1)
        step = max(1, COPY_CHUNK // max(1, s.itemsize))
        jobs += [(d[i : i + step], s[i : i + step]) for i in range(0, s.size, step)]
    if pool is None:
        for d, s in jobs:
            np.copyto(d, s)
    else:
        list(pool.map(lambda d_s: np.copyto(*d_s), jobs))


def _checked(info: TensorInfo, arr: Any, shard: int) -> TensorInfo:
    info = TensorInfo(
        info.name,
        info.kind,
        tuple(int(d) for d in info.shape),
        str(arr.dtype),
        info.start,
        info.stop,
        info.version,
        shard,
    )
    info.check()
    if arr.size != info.stop - info.start:
        raise CheckpointError(
            f"tensor {info.name!r}: {arr.size} values for slice [{info.start}, {info.stop})"
        )
    return info


def commit(
    tmp: str | Location,
    step: int,
    shards: list[dict[str, Any]],
    meta: dict[str, Any] | None = None,
    replace: bool = False,
) -> Location:
    """Write ``params.meta`` and the manifest, then move the directory to ``step-<step>``.

    A committed ``step-<step>`` is refused unless ``replace``; then it is replaced so that a
    crash at any point leaves a whole checkpoint of the step, old or new, for the next writer
    to open (:func:`.placement.commit_dir`, :func:`manage.recover`)."""
    tmp = storage.resolve(tmp)
    ids = sorted(_shard_id(s) for s in shards)
    if ids != list(range(len(shards))):
        raise CheckpointError(f"shards must be numbered 0..{len(shards) - 1}, got {ids}")
    _check_unique(shards)
    lines = [
        "# raysinga checkpoint: name kind shape dtype slice version shard checksum",
        *(
            TensorInfo(**_info_args(t), shard=_shard_id(s)).meta_line(t["xxh3"])
            for s in sorted(shards, key=_shard_id)  # by number: shard-2 before shard-10
            for t in s["tensors"]
        ),
    ]
    meta_bytes = ("\n".join(lines) + "\n").encode()
    with _writing(tmp.join(META)):
        storage.write_bytes(tmp.join(META), meta_bytes)
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "step": step,
        "created": time.time(),
        "meta": meta or {},
        "files": [
            {
                "file": s["file"],
                "size": s["size"],
                "xxh3": s["xxh3"],
                "compression": s["compression"],
            }
            for s in shards
        ]
        + [
            {
                "file": META,
                "size": len(meta_bytes),
                "xxh3": xxhash.xxh3_64_hexdigest(meta_bytes),
                "compression": None,
            }
        ],
        "tensors": [{**t, "shard": _shard_id(s)} for s in shards for t in s["tensors"]],
    }
    sealed = seal(manifest)
    with _writing(tmp.join(MANIFEST)):
        storage.write_bytes(tmp.join(MANIFEST), sealed)
    final = Location(tmp.fs, tmp.path.rsplit(".tmp-", 1)[0])
    with _writing(final):
        commit_dir(tmp, final, replace=replace)
    return final


def _shard_id(shard: dict[str, Any]) -> int:
    """``K`` of a shard record's ``shard-<K>.arrow``."""
    return int(shard["file"].split("-")[1].split(".")[0])


@contextlib.contextmanager
def _writing(loc: Location) -> Iterator[None]:
    """An OSError while writing (a full disk, a lost connection) as a CheckpointError naming
    the file; callers (``save``) remove the temporary directory."""
    try:
        yield
    except OSError as e:
        raise CheckpointError(f"{loc}: could not write: {e}") from e


def _check_unique(shards: list[dict[str, Any]]) -> None:
    """Each slice once, and all slices of a name agree on kind, shape and dtype: a reader keys
    slices by (name, start), so a duplicate would make the checkpoint unreadable."""
    seen: dict[tuple[str, int], None] = {}
    desc: dict[str, tuple[Any, ...]] = {}
    for s in shards:
        for t in s["tensors"]:
            key = (t["name"], t["start"])
            if key in seen:
                raise CheckpointError(
                    f"tensor {t['name']!r}: the slice starting at {t['start']} is stored twice"
                )
            seen[key] = None
            d = (t["kind"], tuple(t["shape"]), t["dtype"])
            if desc.setdefault(t["name"], d) != d:
                raise CheckpointError(
                    f"tensor {t['name']!r}: slices disagree on kind/shape/dtype "
                    f"({desc[t['name']]} vs {d})"
                )


def _info_dict(info: TensorInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "kind": info.kind,
        "shape": list(info.shape),
        "dtype": info.dtype,
        "start": info.start,
        "stop": info.stop,
        "version": info.version,
    }


def _info_args(t: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": t["name"],
        "kind": t["kind"],
        "shape": tuple(t["shape"]),
        "dtype": t["dtype"],
        "start": t["start"],
        "stop": t["stop"],
        "version": t["version"],
    }
