"""Arrow IPC and Parquet data sets, read by index without loading the file.

Both formats store rows in chunks (record batches, row groups). A request is grouped by chunk;
only the chunks it touches are opened, and the last few are kept in a small LRU cache. Arrow IPC
chunks are zero-copy views of a memory map, so caching them costs no memory; Parquet row groups must
be decoded, so only ``cache_chunks`` of them are ever held.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc
import pyarrow.parquet as pq

from raysinga.data_sources import (
    Dataset,
    check_indices,
    classes_from_labels,
    label_kind,
    resolve_sample_shape,
)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)


def column_rows(arr: pa.Array | pa.ChunkedArray, what: str) -> np.ndarray:
    """A column as an array of shape (rows, *cell_shape): a view of the Arrow buffers if possible.

    Cells may be scalars, (nested) fixed-size lists, equal-length lists, or fixed-shape tensors.
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()  # one chunk per batch / row group in practice: no copy
    rows, shape = len(arr), []
    if isinstance(arr.type, pa.FixedShapeTensorType):
        perm = arr.type.permutation
        if perm is not None and list(perm) != sorted(perm):
            raise ValueError(f"column {what!r}: permuted tensor layouts are not supported")
        shape.extend(arr.type.shape)
        arr = arr.storage.flatten()
    while _is_list(arr.type):
        if arr.null_count:
            raise ValueError(f"column {what!r} has null cells")
        if pa.types.is_fixed_size_list(arr.type):
            size = arr.type.list_size
        else:
            lengths = pc.list_value_length(arr)
            size = pc.min(lengths).as_py() or 0
            if pc.max(lengths).as_py() not in (size, None):
                raise ValueError(f"column {what!r} has lists of different lengths")
        shape.append(size)
        arr = arr.flatten()  # respects slice offsets, unlike .values
    if arr.null_count:
        raise ValueError(f"column {what!r} has null values")
    t = arr.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise TypeError(f"column {what!r} must be numeric, got {arr.type}")
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
        missing = [c for c in [*xcols, y] if c not in names]
        if missing:
            raise KeyError(f"{what} has no column(s) {missing}; it holds {list(names)}")
        if not xcols:
            raise ValueError("x needs at least one column")
        if cache_chunks < 1:
            raise ValueError(f"cache_chunks must be >= 1, got {cache_chunks}")
        self._what, self._xcols, self._ycol = what, xcols, y
        self._single_x = isinstance(x, str)
        self._offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self._cache: OrderedDict[int, tuple[list[np.ndarray], np.ndarray]] = OrderedDict()
        self._cache_chunks = cache_chunks
        nonempty = [i for i, n in enumerate(lengths) if n > 0]
        if not nonempty:
            raise ValueError(f"{what} has no rows")
        xs, yv = self._views(nonempty[0])
        if self._single_x:
            stored: tuple[int, ...] = xs[0].shape[1:]
        elif any(v.ndim != 1 for v in xs):
            raise ValueError(f"x columns {xcols} must each hold scalars; use one list column")
        else:
            stored = (len(xs),)
        self.sample_shape = resolve_sample_shape(stored, sample_shape)
        self._kind = label_kind(yv.dtype)
        self.target_shape = tuple(yv.shape[1:]) if self._kind == "target" else ()
        if self._kind == "class" and yv.ndim != 1:
            raise ValueError(f"integer labels in {y!r} must be scalars, got cells {yv.shape[1:]}")
        self._ydtype = np.int64 if self._kind == "class" else np.float32
        self._num_classes = num_classes

    def _load(self, chunk: int, columns: list[str]) -> dict[str, pa.Array | pa.ChunkedArray]:
        raise NotImplementedError

    def _views(self, chunk: int) -> tuple[list[np.ndarray], np.ndarray]:
        if chunk in self._cache:
            self._cache.move_to_end(chunk)
            return self._cache[chunk]
        cols = self._load(chunk, [*self._xcols, self._ycol])
        views = [column_rows(cols[c], c) for c in self._xcols], column_rows(cols[self._ycol], "y")
        self._cache[chunk] = views
        if len(self._cache) > self._cache_chunks:
            self._cache.popitem(last=False)
        return views

    @property
    def num_classes(self) -> int | None:  # type: ignore[override]
        """``max(label) + 1``, from one pass over the label column only, unless given."""
        if self._kind == "target":
            return None
        if self._num_classes is None:
            lo, hi = 0, -1
            for i in range(len(self._offsets) - 1):
                if self._offsets[i + 1] > self._offsets[i]:
                    labels = column_rows(self._load(i, [self._ycol])[self._ycol], self._ycol)
                    lo, hi = min(lo, int(labels.min())), max(hi, int(labels.max()))
            self._num_classes = classes_from_labels(lo, hi)
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
    """Rows of an Arrow IPC *file* (random-access format), memory-mapped.

    ``x`` names one column of (nested) fixed-size lists / fixed-shape tensors, or a list of scalar
    numeric columns (gathered into a vector per row); ``y`` names the label or target column.
    Uncompressed files are read zero-copy; compressed record batches are decompressed on first use
    and the last ``cache_chunks`` kept.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        x: str | Sequence[str] = "x",
        y: str = "y",
        sample_shape: tuple[int, ...] | None = None,
        num_classes: int | None = None,
        cache_chunks: int = 8,
    ) -> None:
        self._args = (os.fspath(path), x, y, sample_shape, num_classes, cache_chunks)
        self._reader = pa.ipc.open_file(pa.memory_map(os.fspath(path), "r"))
        lengths = [
            self._reader.get_batch(i).num_rows for i in range(self._reader.num_record_batches)
        ]
        names = self._reader.schema.names
        self._setup(os.fspath(path), lengths, names, x, y, sample_shape, num_classes, cache_chunks)

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
    (``row_group_size``); for fast random access prefer .npy or Arrow IPC files.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        x: str | Sequence[str] = "x",
        y: str = "y",
        sample_shape: tuple[int, ...] | None = None,
        num_classes: int | None = None,
        cache_chunks: int = 4,
    ) -> None:
        self._args = (os.fspath(path), x, y, sample_shape, num_classes, cache_chunks)
        self._file = pq.ParquetFile(os.fspath(path), memory_map=True)
        meta = self._file.metadata
        lengths = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        names = self._file.schema_arrow.names
        self._setup(os.fspath(path), lengths, names, x, y, sample_shape, num_classes, cache_chunks)

    def __reduce__(self) -> tuple[type, tuple]:
        return ParquetDataset, self._args

    def _load(self, chunk: int, columns: list[str]) -> dict[str, pa.Array | pa.ChunkedArray]:
        table = self._file.read_row_group(chunk, columns=columns)
        return {c: table.column(c) for c in columns}
