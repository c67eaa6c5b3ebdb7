"""Arrow IPC and Parquet data sets, read by index without loading the file.

Both formats store rows in chunks (record batches, row groups). A request is grouped by chunk;
only the chunks it touches are opened, and the last few are kept in a small LRU cache. Arrow IPC
chunks are zero-copy views of a memory map, so caching them costs no memory; Parquet row groups must
be decoded, so only ``cache_chunks`` of them are ever held.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc
import pyarrow.parquet as pq

from .cache import CacheSpec
from .errors import DataError
from .remote import Source, ipc_batch_rows, open_source
from .sources import Dataset, check_indices, label_kind, resolve_sample_shape


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)


def _first(mask: pa.Array | np.ndarray) -> int:
    return int(np.flatnonzero(np.asarray(mask))[0])


def column_rows(arr: pa.Array | pa.ChunkedArray, **origin: Any) -> np.ndarray:
    """A column as an array of shape (rows, *cell_shape): a view of the Arrow buffers if possible.

    Cells may be scalars, (nested) fixed-size lists, equal-length lists, or fixed-shape tensors.
    A null or a list of another length is a DataError at its row (of this array).
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()  # one chunk per batch / row group in practice: no copy
    rows, shape, per_row = len(arr), [], 1  # per_row: values of the current level per row
    if isinstance(arr.type, pa.FixedShapeTensorType):
        perm = arr.type.permutation
        if perm is not None and list(perm) != sorted(perm):
            raise DataError("permuted tensor layouts are not supported", **origin)
        shape.extend(arr.type.shape)
        arr = arr.storage.flatten()
        per_row = int(np.prod(shape))
    while _is_list(arr.type):
        if arr.null_count:
            raise DataError("null cell", row=_first(arr.is_null()) // per_row, **origin)
        if pa.types.is_fixed_size_list(arr.type):
            size = arr.type.list_size
            # The child sliced to this array's rows: what flatten() returns, without its slow
            # generic path (it copies at about 1 GB/s; this is zero-copy).
            child = arr.values.slice(arr.offset * size, len(arr) * size)
        else:
            lengths = pc.list_value_length(arr)
            size = pc.min(lengths).as_py() or 0
            if pc.max(lengths).as_py() not in (size, None):
                other = _first(pc.not_equal(lengths, lengths[0]))
                raise DataError(
                    f"lists of different lengths: {lengths[other]} here, {lengths[0]} in the "
                    "first cell; every sample needs the same shape",
                    row=other // per_row,
                    **origin,
                )
            child = arr.flatten()  # respects slice offsets, unlike .values
        shape.append(size)
        per_row *= size
        arr = child
    if arr.null_count:
        raise DataError("null value", row=_first(arr.is_null()) // max(per_row, 1), **origin)
    t = arr.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        hint = "; number class names 0..k-1 first" if pa.types.is_string(t) else ""
        raise DataError(f"must hold numbers, got Arrow type {arr.type}{hint}", **origin)
    return np.asarray(arr).reshape(rows, *shape)


class _ChunkedDataset(Dataset):
    """Shared indexing for formats whose rows live in consecutive chunks."""

    def _setup(
        self,
        what: str,
        lengths: Sequence[int],
        names: Sequence[str],
        x: str | Sequence[str],
        y: str,
        sample_shape: tuple[int, ...] | None,
        num_classes: int | None,
        cache_chunks: int,
    ) -> None:
        xcols = [x] if isinstance(x, str) else list(x)
        if not xcols:
            raise DataError("x needs at least one column", file=what)
        missing = [c for c in [*xcols, y] if c not in names]
        if missing:
            key = f"column {missing[0]!r}" if len(missing) == 1 else f"columns {missing}"
            raise DataError(
                f"no such column; the file holds {list(names)} (x and y of data.source choose)",
                file=what,
                key=key,
            )
        if cache_chunks < 1:
            raise ValueError(f"cache_chunks must be >= 1, got {cache_chunks}")
        self._what, self._xcols, self._ycol = what, xcols, y
        self._single_x = isinstance(x, str)
        self._offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self._cache: OrderedDict[int, tuple[list[np.ndarray], np.ndarray]] = OrderedDict()
        self._cache_chunks = cache_chunks
        nonempty = [i for i, n in enumerate(lengths) if n > 0]
        if not nonempty:
            raise DataError("has no rows", file=what)
        xs, yv = self._views(nonempty[0])
        xo = self._origin(xcols[0] if self._single_x else xcols)
        if self._single_x:
            stored: tuple[int, ...] = xs[0].shape[1:]
        elif any(v.ndim != 1 for v in xs):
            raise DataError("x columns must each hold scalars; use one list column", **xo)
        else:
            stored = (len(xs),)
        self.sample_shape = resolve_sample_shape(stored, sample_shape, **xo)
        self._kind = label_kind(yv.dtype, **self._origin(y))
        self.label_dtype = yv.dtype
        self.target_shape = tuple(yv.shape[1:]) if self._kind == "target" else ()
        if self._kind == "class" and yv.ndim != 1:
            raise DataError(
                f"integer labels must be scalars, got cells {yv.shape[1:]}", **self._origin(y)
            )
        self._ydtype = np.int64 if self._kind == "class" else np.float32
        self._num_classes = num_classes

    def _origin(self, column: str | list[str]) -> dict[str, Any]:
        key = f"column {column!r}" if isinstance(column, str) else f"columns {column}"
        return {"file": self._what, "key": key}

    def _load(self, chunk: int, columns: list[str]) -> dict[str, pa.Array | pa.ChunkedArray]:
        raise NotImplementedError

    def _read(self, chunk: int, columns: list[str]) -> dict[str, pa.Array | pa.ChunkedArray]:
        try:
            return self._load(chunk, columns)
        except (pa.ArrowException, OSError) as e:  # a corrupt chunk: the file's fault
            lo, hi = int(self._offsets[chunk]), int(self._offsets[chunk + 1])
            raise DataError(
                f"rows {lo}..{hi - 1} (chunk {chunk}) cannot be read: {e}", file=self._what
            ) from None

    def _column(self, chunk: int, cols: dict[str, Any], name: str) -> np.ndarray:
        try:
            return column_rows(cols[name], **self._origin(name))
        except DataError as e:  # its row counts from the chunk's start
            raise e.at(row_offset=int(self._offsets[chunk])) from None

    def _views(self, chunk: int) -> tuple[list[np.ndarray], np.ndarray]:
        if chunk in self._cache:
            self._cache.move_to_end(chunk)
            return self._cache[chunk]
        cols = self._read(chunk, [*self._xcols, self._ycol])
        xs = [self._column(chunk, cols, c) for c in self._xcols]
        views = xs, self._column(chunk, cols, self._ycol)
        self._cache[chunk] = views
        if len(self._cache) > self._cache_chunks:
            self._cache.popitem(last=False)
        return views

    def labels(self, start: int, stop: int) -> np.ndarray:
        """The label column of rows ``[start, stop)``, read without the samples."""
        first = int(np.searchsorted(self._offsets, start, side="right")) - 1
        parts = []
        for i in range(first, len(self._offsets) - 1):
            lo, hi = int(self._offsets[i]), int(self._offsets[i + 1])
            if lo >= stop:
                break
            if hi > lo:
                labels = self._column(i, self._read(i, [self._ycol]), self._ycol)
                parts.append(labels[max(start, lo) - lo : min(stop, hi) - lo])
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.label_dtype)

    @property
    def num_classes(self) -> int | None:  # type: ignore[override]
        """``max(label) + 1``, from one pass over the label column only, unless given."""
        if self._kind == "target":
            return None
        if self._num_classes is None:
            hi = -1
            for i in range(len(self._offsets) - 1):
                labels = self.labels(int(self._offsets[i]), int(self._offsets[i + 1]))
                if len(labels) and labels.min() < 0:
                    j = int(np.argmax(labels < 0))
                    raise DataError(
                        f"class labels must be >= 0, got {labels[j]}",
                        row=int(self._offsets[i]) + j,
                        **self._origin(self._ycol),
                    )
                hi = max(hi, int(labels.max())) if len(labels) else hi
            self._num_classes = hi + 1
        return self._num_classes

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def get(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = check_indices(indices, len(self))
        stored = self.sample_shape if self._single_x else (len(self._xcols),)
        x = np.empty((len(idx), *stored), dtype=np.float32)
        y = np.empty((len(idx), *self.target_shape), dtype=self._ydtype)
        if len(idx) == 0:
            return x, y
        chunk_of = np.searchsorted(self._offsets, idx, side="right") - 1
        by_chunk = np.argsort(chunk_of, kind="stable")
        chunks, starts = np.unique(chunk_of[by_chunk], return_index=True)
        for chunk, sel in zip(chunks, np.split(by_chunk, starts[1:]), strict=True):
            local = idx[sel] - self._offsets[chunk]
            xs, yv = self._views(int(chunk))
            if self._single_x:
                x[sel] = xs[0][local].reshape(len(sel), *stored)
            else:
                for j, col in enumerate(xs):
                    x[sel, j] = col[local]
            y[sel] = yv[local]
        return x.reshape(len(idx), *self.sample_shape), y


class ArrowDataset(_ChunkedDataset):
    """Rows of an Arrow IPC *file* (random-access format): memory-mapped, or behind a URI.

    ``x`` names one column of (nested) fixed-size lists / fixed-shape tensors, or a list of scalar
    numeric columns (gathered into a vector per row); ``y`` names the label or target column.
    Uncompressed local files are read zero-copy; compressed record batches are decompressed on
    first use and the last ``cache_chunks`` kept. A file behind a URI (:mod:`.data_remote`) is
    read through the node's block cache ``cache``, only the x and y columns of a batch.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        x: str | Sequence[str] = "x",
        y: str = "y",
        sample_shape: tuple[int, ...] | None = None,
        num_classes: int | None = None,
        cache_chunks: int = 8,
        cache: CacheSpec | None = None,
    ) -> None:
        self._args = (os.fspath(path), x, y, sample_shape, num_classes, cache_chunks, cache)
        src = open_source(path, cache)
        try:
            self._reader = pa.ipc.open_file(src.file)
            lengths = self._lengths(src, x, y)
        except (pa.ArrowInvalid, OSError, ValueError, struct.error) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(
                f"is not an Arrow IPC file ({e}); write one with pyarrow.ipc.new_file "
                "(the random-access format, not a stream)",
                file=src.name,
            ) from None
        names = self._reader.schema.names
        self._setup(src.name, lengths, names, x, y, sample_shape, num_classes, cache_chunks)

    def _lengths(self, src: Source, x: str | Sequence[str], y: str) -> list[int]:
        """Rows per record batch. A mapped file's batches cost nothing to open; a remote one's
        headers are read alone, and its reader reopened to read only the needed columns."""
        count = self._reader.num_record_batches
        if src.remote is None:
            return [self._reader.get_batch(i).num_rows for i in range(count)]
        lengths = ipc_batch_rows(src.remote)
        if len(lengths) != count:
            raise ValueError(f"{len(lengths)} batch headers for {count} record batches")
        names = self._reader.schema.names
        wanted = {*([x] if isinstance(x, str) else x), y}
        fields = [i for i, n in enumerate(names) if n in wanted]
        if fields:  # none: _setup names the missing columns
            options = pa.ipc.IpcReadOptions(included_fields=fields)
            self._reader = pa.ipc.open_file(src.file, options=options)
        return lengths

    def __reduce__(self) -> tuple[type, tuple]:
        return ArrowDataset, self._args  # reopen the file rather than pickle the mapped data

    def _load(self, chunk: int, columns: list[str]) -> dict[str, pa.Array | pa.ChunkedArray]:
        batch = self._reader.get_batch(chunk)
        return {c: batch.column(c) for c in columns}


class ParquetDataset(_ChunkedDataset):
    """Rows of a Parquet file, decoded one row group at a time.

    Only the row groups holding requested indices are decoded, and at most ``cache_chunks`` are
    kept, so memory stays at a few row groups whatever the file size. A shuffled batch touches many
    row groups and each touch is a decode, so write such files with small row groups
    (``row_group_size``); for fast random access prefer .npy or Arrow IPC files. A file behind
    a URI (:mod:`.data_remote`) is read by byte range through the node's block cache ``cache``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        x: str | Sequence[str] = "x",
        y: str = "y",
        sample_shape: tuple[int, ...] | None = None,
        num_classes: int | None = None,
        cache_chunks: int = 4,
        cache: CacheSpec | None = None,
    ) -> None:
        self._args = (os.fspath(path), x, y, sample_shape, num_classes, cache_chunks, cache)
        src = open_source(path, cache)  # outside the try: a missing file is no corrupt Parquet file
        try:
            self._file = pq.ParquetFile(src.file)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"is not a Parquet file ({e})", file=src.name) from None
        meta = self._file.metadata
        lengths = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        names = self._file.schema_arrow.names
        self._setup(src.name, lengths, names, x, y, sample_shape, num_classes, cache_chunks)

    def __reduce__(self) -> tuple[type, tuple]:
        return ParquetDataset, self._args

    def _load(self, chunk: int, columns: list[str]) -> dict[str, pa.Array | pa.ChunkedArray]:
        table = self._file.read_row_group(chunk, columns=columns)
        return {c: table.column(c) for c in columns}
