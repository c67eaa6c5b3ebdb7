"""In-memory and NumPy-file data sets: ``Dataset``, ``ArrayDataset``, ``NpyDataset``,
``NpzDataset``.

Files are read through ``pyarrow.memory_map`` and viewed with ``np.frombuffer``: opening costs
nothing, ``get`` touches only the pages of the requested rows, and a data set larger than memory
works because the page cache, not the process, holds the file.
"""

from __future__ import annotations

import os
import struct
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from .errors import DataError, where

# Where an array comes from, for error messages: DataError's ``file`` and ``key``.
Origin = Mapping[str, Any]


class Dataset:
    """What the trainer needs from a data set: its size, the shape of a sample, rows by index.

    ``get`` returns ``x`` as float32 C-contiguous of shape ``(len(indices), *sample_shape)`` and
    ``y`` as int64 labels of shape ``(len(indices),)``, or float32 regression targets of shape
    ``(len(indices), *target_shape)``. ``num_classes`` is None for regression. ``label_dtype``
    is the labels' dtype as stored, which error messages name. A data set may also offer
    ``labels(start, stop)``: the stored labels of a row range without their samples, which lets
    a check read every label of a split too large to read whole. ``generated`` data sets compute
    their rows, finite and labelled in ``[0, num_classes)`` by construction: checks read none.
    """

    sample_shape: tuple[int, ...]
    target_shape: tuple[int, ...] = ()
    num_classes: int | None
    label_dtype: np.dtype | None = None
    generated: bool = False

    def __len__(self) -> int:
        raise NotImplementedError

    def get(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError


def check_indices(indices: Any, n: int) -> np.ndarray:
    """``indices`` as a 1-D int64 array in ``[0, n)``; negative indices are refused, not wrapped."""
    idx = np.asarray(indices)
    if idx.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {idx.shape}")
    if idx.size == 0:
        return idx.astype(np.int64)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
    lo, hi = idx.min(), idx.max()
    if lo < 0 or hi >= n:
        raise IndexError(f"indices must lie in [0, {n}), got min {lo} and max {hi}")
    return idx.astype(np.int64, copy=False)


def resolve_sample_shape(
    stored: tuple[int, ...], sample_shape: tuple[int, ...] | list[int] | None, **origin: Any
) -> tuple[int, ...]:
    """The requested per-sample shape, checked to hold the same number of values as stored."""
    if sample_shape is None:
        return tuple(int(s) for s in stored)
    shape = tuple(int(s) for s in sample_shape)
    if int(np.prod(shape, dtype=np.int64)) != int(np.prod(stored, dtype=np.int64)):
        raise DataError(
            f"sample_shape {list(shape)} does not hold the {list(stored)} values of a sample",
            **origin,
        )
    return shape


def check_samples(dtype: np.dtype, **origin: Any) -> None:
    if dtype.kind not in "iubf":
        raise DataError(f"samples must be numbers, got dtype {dtype}", **origin)


def label_kind(dtype: np.dtype, **origin: Any) -> str:
    """'class' for integer/bool labels, 'target' for float targets; anything else is refused."""
    if dtype.kind in "iub":
        return "class"
    if dtype.kind == "f":
        return "target"
    hint = ""
    if dtype.kind in "USO":
        hint = "; number the classes 0..k-1 first (np.unique(y, return_inverse=True))"
    raise DataError(
        f"labels must be integer classes or float targets, got dtype {dtype}{hint}", **origin
    )


class ArrayDataset(Dataset):
    """Samples held as two arrays ``x`` (n, ...) and ``y`` (n, ...): in memory or memory-mapped.

    The arrays are kept as given (no copy); ``get`` gathers the requested rows and converts them.
    ``num_classes`` is ``max(y) + 1`` for integer labels, computed on first use unless given.
    ``origin`` names where x and y come from (DataError's ``file`` and ``key``) for messages.
    """

    def __init__(
        self,
        x: np.ndarray,
        y: np.ndarray,
        sample_shape: tuple[int, ...] | None = None,
        num_classes: int | None = None,
        origin: tuple[Origin, Origin] = ({"key": "x array"}, {"key": "y array"}),
    ) -> None:
        x, y = np.asarray(x), np.asarray(y)
        xo, yo = origin
        if x.ndim < 1 or y.ndim < 1 or len(x) != len(y):
            raise DataError(
                f"has shape {x.shape}, but y ({yo.get('file') or yo.get('key')}) has shape "
                f"{y.shape}; x and y need the same number of rows, one per sample",
                **xo,
            )
        check_samples(x.dtype, **xo)
        self._x, self._y, self._yo = x, y, yo
        self._kind = label_kind(y.dtype, **yo)
        self.label_dtype = y.dtype
        self.sample_shape = resolve_sample_shape(x.shape[1:], sample_shape, **xo)
        self.target_shape = tuple(y.shape[1:]) if self._kind == "target" else ()
        if self._kind == "class" and y.ndim != 1:
            raise DataError(f"integer labels must be 1-D, got shape {y.shape}", **yo)
        self._num_classes = num_classes

    @property
    def num_classes(self) -> int | None:  # type: ignore[override]
        if self._kind == "target":
            return None
        if self._num_classes is None:
            y = self._y
            if len(y) and y.min() < 0:
                row = int(np.argmax(y < 0))
                raise DataError(f"class labels must be >= 0, got {y[row]}", row=row, **self._yo)
            self._num_classes = int(y.max()) + 1 if len(y) else 0
        return self._num_classes

    def __len__(self) -> int:
        return len(self._x)

    def labels(self, start: int, stop: int) -> np.ndarray:
        return self._y[start:stop]

    def get(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = check_indices(indices, len(self._x))
        x = np.ascontiguousarray(self._x[idx], dtype=np.float32).reshape(-1, *self.sample_shape)
        ydtype = np.int64 if self._kind == "class" else np.float32
        return x, np.ascontiguousarray(self._y[idx], dtype=ydtype)


def npy_view(buf: pa.Buffer, offset: int = 0, **origin: Any) -> np.ndarray:
    """Zero-copy view of the .npy image starting at byte ``offset`` of ``buf``.

    ``numpy.lib.format`` reads and validates the header (magic, version, keys, shape, dtype, and
    a size limit against hostile headers); the payload is not read but viewed where it lies, so
    the view keeps ``buf`` (and so the memory map) alive. Read-only, C order only.
    """
    fmt = np.lib.format
    reader = pa.BufferReader(buf)  # a file over the map: reading the header copies only it
    reader.seek(offset)
    try:
        major, minor = fmt.read_magic(reader)
        if major == 1:
            shape, fortran, dtype = fmt.read_array_header_1_0(reader)
        elif major in (2, 3):
            # 3.0 differs from 2.0 only in a UTF-8 header, which only structured dtypes with
            # non-Latin-1 field names need; ASCII reads alike, and structured x or y is refused.
            shape, fortran, dtype = fmt.read_array_header_2_0(reader)
        else:
            raise ValueError(f"unsupported .npy format version {major}.{minor}")
    except ValueError as e:  # numpy says what is wrong, not in which file
        reason = " ".join(str(e).split())  # numpy's messages may span lines; ours is one
        raise DataError(f"not a readable .npy file: {reason}", **origin) from None
    if fortran and len(shape) > 1:
        raise DataError(
            "is stored in Fortran order; only C order can be read row by row. "
            "Rewrite it with np.save(path, np.ascontiguousarray(a)).",
            **origin,
        )
    if dtype.hasobject:
        raise DataError("holds Python objects (pickle); refusing to load it", **origin)
    count = int(np.prod(shape, dtype=np.int64))
    data_start = reader.tell()
    if data_start + count * dtype.itemsize > buf.size:
        raise DataError(f"is truncated: its header promises {shape} of {dtype}", **origin)
    return np.frombuffer(buf, dtype=dtype, count=count, offset=data_start).reshape(shape)


def open_map(path: str | os.PathLike[str], **origin: Any) -> pa.MemoryMappedFile:
    """``path`` memory-mapped read-only; a missing, unreadable or empty file named as such."""
    file = os.fspath(path)
    origin = {"file": file, **origin}
    if os.path.isdir(file):
        raise DataError("is a directory, not a file; give the path of a file in it", **origin)
    try:
        mm = pa.memory_map(file, "r")
    except FileNotFoundError:
        raise FileNotFoundError(f"{where(**origin)}: no such file") from None
    except OSError as e:  # permissions and the like: still the user's input, not our bug
        raise DataError(f"cannot be read: {e}", **origin) from None
    if mm.size() == 0:
        raise DataError("is empty (0 bytes)", **origin)
    return mm


def map_file(path: str | os.PathLike[str], **origin: Any) -> pa.Buffer:
    """The whole file as one read-only, zero-copy Arrow buffer over a memory map."""
    return open_map(path, **origin).read_buffer()  # a slice of the map; keeps the map alive


class NpyDataset(ArrayDataset):
    """``x`` and ``y`` from two .npy files, memory-mapped: zero-copy, fine larger than memory."""

    def __init__(
        self,
        x_path: str | os.PathLike[str],
        y_path: str | os.PathLike[str],
        sample_shape: tuple[int, ...] | None = None,
        num_classes: int | None = None,
    ) -> None:
        self._args = (os.fspath(x_path), os.fspath(y_path), sample_shape, num_classes)
        xo = {"file": os.fspath(x_path), "key": "x array"}
        yo = {"file": os.fspath(y_path), "key": "y array"}
        x = npy_view(map_file(x_path, key=xo["key"]), **xo)
        y = npy_view(map_file(y_path, key=yo["key"]), **yo)
        super().__init__(x, y, sample_shape, num_classes, origin=(xo, yo))

    def __reduce__(self) -> tuple[type, tuple]:
        return NpyDataset, self._args  # reopen the files rather than pickle the mapped data


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length


def _npz_member(
    zf: zipfile.ZipFile, buf: pa.Buffer, key: str, path: str, spec_key: str
) -> np.ndarray:
    origin = {"file": path, "key": f"key {key!r}"}
    name = key if key in zf.NameToInfo else f"{key}.npy"
    if name not in zf.NameToInfo:
        keys = sorted(n[:-4] if n.endswith(".npy") else n for n in zf.namelist())
        raise DataError(
            f"no such key; the archive holds {keys} ({spec_key} of data.source chooses)", **origin
        )
    info = zf.getinfo(name)
    if info.flag_bits & 0x1:
        raise DataError("is encrypted", **origin)
    if info.compress_type != zipfile.ZIP_STORED:
        # A compressed member has no bytes to map: inflate it into memory (np.savez_compressed).
        try:
            with zf.open(info) as f:
                return np.lib.format.read_array(f, allow_pickle=False)
        except (ValueError, zipfile.BadZipFile, OSError) as e:  # zlib.error is not one of them
            raise DataError(f"not a readable .npy member: {e}", **origin) from None
    header = bytes(memoryview(buf)[info.header_offset : info.header_offset + _LOCAL_HEADER.size])
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        raise DataError("bad zip local header", **origin)
    return npy_view(buf, info.header_offset + _LOCAL_HEADER.size + name_len + extra_len, **origin)


class NpzDataset(ArrayDataset):
    """``x`` and ``y`` from one .npz archive.

    Members written by ``np.savez`` (stored, not compressed) are memory-mapped zero-copy at their
    offset inside the zip. Members written by ``np.savez_compressed`` cannot be mapped: they are
    inflated into memory when the data set is opened, so they must fit in memory.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        x_key: str = "x",
        y_key: str = "y",
        sample_shape: tuple[int, ...] | None = None,
        num_classes: int | None = None,
    ) -> None:
        path = os.fspath(path)
        self._args = (path, x_key, y_key, sample_shape, num_classes)
        buf = map_file(path)
        try:
            with zipfile.ZipFile(path) as zf:
                x = _npz_member(zf, buf, x_key, path, "x_key")
                y = _npz_member(zf, buf, y_key, path, "y_key")
        except zipfile.BadZipFile as e:
            raise DataError(
                f"is not an .npz archive ({e}); write one with np.savez, "
                "or use kind npy for a single .npy file",
                file=path,
            ) from None
        origin = ({"file": path, "key": f"key {x_key!r}"}, {"file": path, "key": f"key {y_key!r}"})
        super().__init__(x, y, sample_shape, num_classes, origin=origin)

    def __reduce__(self) -> tuple[type, tuple]:
        return NpzDataset, self._args
