"""A Ray Data ``Dataset`` as a data source: written once, in a fixed order, as an Arrow IPC file.

A run reads its samples by index, on every worker and again on a resume, so its data must be a
fixed sequence of rows. A Ray Data pipeline is not one (its blocks arrive as tasks finish, and it
is computed anew on each iteration), so :func:`from_ray_dataset` materialises it: in the
Dataset's own order (Ray Data's ``preserve_order``), in record batches of a fixed number of rows,
into an Arrow IPC file that every process then reads (memory-mapped, or through the block cache
when the file is behind a URI). The file is written under a temporary name and put in place only
when whole; where a file with the same bytes is already there it is kept as it is.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import xxhash

from raysinga.checkpoint.storage import fsync_path, redact_text

from .errors import DataError
from .remote import is_uri, what

ROWS_PER_BATCH = 8192  # rows per record batch of the file: one header read each when remote
_READ = 8 * 2**20


def from_ray_dataset(
    ds: Any,
    path: str | os.PathLike[str],
    x: str | Sequence[str] = "x",
    y: str = "y",
    *,
    test: Any = None,
    test_path: str | os.PathLike[str] | None = None,
    rows_per_batch: int = ROWS_PER_BATCH,
) -> dict[str, Any]:
    """Write the Ray Dataset ``ds`` (columns ``x`` and ``y``) to ``path``, a local path or a
    pyarrow URI, and return the ``data.source`` mapping that reads it. ``test`` (a Dataset)
    goes to ``test_path`` and becomes the source's test split.

    Columns of scalars stay columns; tensor columns become fixed-shape tensor columns, so the
    sample shape is kept. Every row passes through this process, once per call.
    """
    if (test is None) != (test_path is None):
        raise ValueError("test and test_path go together: the test split's Dataset and its file")
    if (
        isinstance(rows_per_batch, bool)
        or not isinstance(rows_per_batch, int)
        or rows_per_batch < 1
    ):
        raise ValueError(f"rows_per_batch must be a positive integer, got {rows_per_batch!r}")
    columns = [*([x] if isinstance(x, str) else list(x)), y]
    xs = x if isinstance(x, str) else list(x)
    spec: dict[str, Any] = {"kind": "arrow", "path": os.fspath(path), "x": xs, "y": y}
    materialise(ds, path, columns, rows_per_batch)
    if test is not None:
        materialise(test, test_path, columns, rows_per_batch)
        spec["test"] = {"path": os.fspath(test_path)}
    return spec


def materialise(ds: Any, path: Any, columns: list[str], rows_per_batch: int) -> None:
    """``ds``'s ``columns`` as the Arrow IPC file ``path``, unless it already holds them."""
    if not (hasattr(ds, "iter_batches") and hasattr(ds, "context")):
        raise TypeError(f"expected a ray.data.Dataset, got {type(ds).__name__}")
    fs, where = _resolve(os.fspath(path))
    tmp = f"{where}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        _write(ds, fs, tmp, columns, rows_per_batch, what(os.fspath(path)))
        if _same_bytes(fs, tmp, where):
            fs.delete_file(tmp)  # the file in place stays, and with it the nodes' caches of it
            return
        if isinstance(fs, pafs.LocalFileSystem):
            fsync_path(tmp)
            os.replace(tmp, where)
            fsync_path(os.path.dirname(where), directory=True)
        else:
            fs.move(tmp, where)  # object stores: a server-side copy, whole or not at all
    except BaseException:
        with contextlib.suppress(OSError):
            fs.delete_file(tmp)
        raise


def _resolve(path: str) -> tuple[pafs.FileSystem, str]:
    if not is_uri(path):
        where = os.path.abspath(path)
        os.makedirs(os.path.dirname(where), exist_ok=True)
        return pafs.LocalFileSystem(), where
    try:
        return pafs.FileSystem.from_uri(path)
    except (ValueError, OSError, TypeError) as e:
        raise DataError(
            f"cannot open this location: {redact_text(str(e))}", file=what(path)
        ) from None


def _write(
    ds: Any, fs: pafs.FileSystem, tmp: str, columns: list[str], rows: int, name: str
) -> None:
    options = ds.context.execution_options
    saved, options.preserve_order = options.preserve_order, True
    writer, schema = None, None
    try:
        with fs.open_output_stream(tmp) as sink:
            for batch in ds.iter_batches(batch_size=rows, batch_format="numpy"):
                record = _record_batch(batch, columns, name)
                if writer is None:
                    schema = record.schema
                    writer = pa.ipc.new_file(sink, schema)
                elif record.schema != schema:
                    raise DataError(
                        f"column types change between batches: {schema} then {record.schema}",
                        file=name,
                    )
                writer.write_batch(record)
            if writer is None:
                raise DataError("the Ray Dataset has no rows", file=name)
            writer.close()
    finally:
        options.preserve_order = saved


def _record_batch(batch: dict[str, np.ndarray], columns: list[str], name: str) -> pa.RecordBatch:
    missing = [c for c in columns if c not in batch]
    if missing:
        raise DataError(
            f"the Ray Dataset has no column(s) {missing}; it holds {sorted(batch)} "
            "(x and y of from_ray_dataset choose)",
            file=name,
        )
    arrays = []
    for c in columns:
        a = np.asarray(batch[c])
        if a.dtype.kind not in "biuf":
            raise DataError(
                f"column {c!r} of the Ray Dataset holds {a.dtype} values (ragged tensors or "
                "strings?); samples and labels must be numbers of one shape per row",
                file=name,
            )
        if a.ndim == 1:
            arrays.append(pa.array(a))
        else:
            arrays.append(pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(a)))
    return pa.record_batch(arrays, names=columns)


def _same_bytes(fs: pafs.FileSystem, a: str, b: str) -> bool:
    """Whether files ``a`` and ``b`` hold the same bytes: same size, then the same hash."""
    sizes = [fs.get_file_info(p) for p in (a, b)]
    if sizes[1].type != pafs.FileType.File or sizes[0].size != sizes[1].size:
        return False
    return _digest(fs, a) == _digest(fs, b)


def _digest(fs: pafs.FileSystem, path: str) -> str:
    h = xxhash.xxh3_128()
    with fs.open_input_stream(path) as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.hexdigest()
