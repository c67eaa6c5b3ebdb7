"""In-memory and NumPy-file data sets: ``Dataset``, ``ArrayDataset``, ``NpyDataset``,
``NpzDataset``.

Files are read through ``pyarrow.memory_map`` and viewed with ``np.frombuffer``: opening costs
nothing, ``get`` touches only the pages of the requested rows, and a data set larger than memory
works because the page cache, not the process, holds the file.
"""

from __future__ import annotations

import ast
import os
import struct
import zipfile
from typing import Any

import numpy as np
import pyarrow as pa

_NPY_MAGIC = b"\x93NUMPY"


class Dataset:
    """What the trainer needs from a data set: its size, the shape of a sample, rows by index.

    ``get`` returns ``x`` as float32 C-contiguous of shape ``(len(indices), *sample_shape)`` and
    ``y`` as int64 labels of shape ``(len(indices),)``, or float32 regression targets of shape
    ``(len(indices), *target_shape)``. ``num_classes`` is None for regression.
    """

    sample_shape: tuple[int, ...]
    target_shape: tuple[int, ...] = ()
    num_classes: int | None

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
    stored: tuple[int, ...], sample_shape: tuple[int, ...] | list[int] | None
) -> tuple[int, ...]:
    """The requested per-sample shape, checked to hold the same number of values as stored."""
    if sample_shape is None:
        return tuple(int(s) for s in stored)
    shape = tuple(int(s) for s in sample_shape)
    if int(np.prod(shape, dtype=np.int64)) != int(np.prod(stored, dtype=np.int64)):
        raise ValueError(f"sample_shape {shape} does not hold the {stored} values of a sample")
    return shape


def label_kind(dtype: np.dtype) -> str:
    """'class' for integer/bool labels, 'target' for float targets; anything else is refused."""
    if dtype.kind in "iub":
        return "class"
    if dtype.kind == "f":
        return "target"
    raise TypeError(f"y must hold integer labels or float targets, got dtype {dtype}")


def classes_from_labels(lo: int, hi: int) -> int:
    if lo < 0:
        raise ValueError(f"class labels must be >= 0, got {lo}")
    return int(hi) + 1


class ArrayDataset(Dataset):
    """Samples held as two arrays ``x`` (n, ...) and ``y`` (n, ...): in memory or memory-mapped.

    The arrays are kept as given (no copy); ``get`` gathers the requested rows and converts them.
    ``num_classes`` is ``max(y) + 1`` for integer labels, computed on first use unless given.
    """

    def __init__(
        self,
        x: np.ndarray,
        y: np.ndarray,
        sample_shape: tuple[int, ...] | None = None,
        num_classes: int | None = None,
    ) -> None:
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim < 1 or y.ndim < 1 or len(x) != len(y):
            raise ValueError(f"x and y need the same number of rows, got {x.shape} and {y.shape}")
        if x.dtype.kind not in "iubf":
            raise TypeError(f"x must be numeric, got dtype {x.dtype}")
        self._x, self._y = x, y
        self._kind = label_kind(y.dtype)
        self.sample_shape = resolve_sample_shape(x.shape[1:], sample_shape)
        self.target_shape = tuple(y.shape[1:]) if self._kind == "target" else ()
        if self._kind == "class" and y.ndim != 1:
            raise ValueError(f"integer labels must be 1-D, got shape {y.shape}")
        self._num_classes = num_classes

    @property
    def num_classes(self) -> int | None:  # type: ignore[override]
        if self._kind == "target":
            return None
        if self._num_classes is None:
            y = self._y
            self._num_classes = classes_from_labels(y.min(), y.max()) if len(y) else 0
        return self._num_classes

    def __len__(self) -> int:
        return len(self._x)

    def get(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = check_indices(indices, len(self._x))
        x = np.ascontiguousarray(self._x[idx], dtype=np.float32).reshape(-1, *self.sample_shape)
        ydtype = np.int64 if self._kind == "class" else np.float32
        return x, np.ascontiguousarray(self._y[idx], dtype=ydtype)


def npy_view(buf: pa.Buffer, offset: int = 0, what: str = "array") -> np.ndarray:
    """Zero-copy view of the .npy image starting at byte ``offset`` of ``buf``.

    The header is parsed here rather than by ``np.load`` because ``np.load`` would read the data;
    the view keeps ``buf`` (and so the memory map) alive. Read-only, C order only.
    """
    mem = memoryview(buf)
    if bytes(mem[offset : offset + 6]) != _NPY_MAGIC:
        raise ValueError(f"{what} is not a .npy file (bad magic)")
    major = mem[offset + 6]
    if major == 1:
        (hlen,), start = struct.unpack("<H", mem[offset + 8 : offset + 10]), offset + 10
    elif major in (2, 3):
        (hlen,), start = struct.unpack("<I", mem[offset + 8 : offset + 12]), offset + 12
    else:
        raise ValueError(f"{what}: unsupported .npy format version {major}")
    encoding = "utf8" if major == 3 else "latin1"
    header = ast.literal_eval(bytes(mem[start : start + hlen]).decode(encoding))
    if not isinstance(header, dict) or {"descr", "fortran_order", "shape"} - header.keys():
        raise ValueError(f"{what}: malformed .npy header {header!r}")
    dtype = np.lib.format.descr_to_dtype(header["descr"])
    shape = tuple(header["shape"])
    if header["fortran_order"] and len(shape) > 1:
        raise ValueError(
            f"{what} is stored in Fortran order; only C order can be read row by row. "
            "Rewrite it with np.save(path, np.ascontiguousarray(a))."
        )
    if dtype.hasobject:
        raise ValueError(f"{what} holds Python objects (pickle); refusing to load it")
    count = int(np.prod(shape, dtype=np.int64))
    data_start = start + hlen
    if data_start + count * dtype.itemsize > buf.size:
        raise ValueError(f"{what} is truncated: header promises {shape} of {dtype}")
    return np.frombuffer(buf, dtype=dtype, count=count, offset=data_start).reshape(shape)


def map_file(path: str | os.PathLike[str]) -> pa.Buffer:
    """The whole file as one read-only, zero-copy Arrow buffer over a memory map."""
    mm = pa.memory_map(os.fspath(path), "r")
    return mm.read_buffer()  # a slice of the map, which it keeps alive after mm is closed


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
        x = npy_view(map_file(x_path), what=os.fspath(x_path))
        y = npy_view(map_file(y_path), what=os.fspath(y_path))
        super().__init__(x, y, sample_shape, num_classes)

    def __reduce__(self) -> tuple[type, tuple]:
        return NpyDataset, self._args  # reopen the files rather than pickle the mapped data


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length


def _npz_member(zf: zipfile.ZipFile, buf: pa.Buffer, key: str, path: str) -> np.ndarray:
    name = key if key in zf.NameToInfo else f"{key}.npy"
    if name not in zf.NameToInfo:
        keys = sorted(n[:-4] if n.endswith(".npy") else n for n in zf.namelist())
        raise KeyError(f"{path} has no member {key!r}; it holds {keys}")
    info = zf.getinfo(name)
    what = f"{path}[{key}]"
    if info.flag_bits & 0x1:
        raise ValueError(f"{what} is encrypted")
    if info.compress_type != zipfile.ZIP_STORED:
        # A compressed member has no bytes to map: inflate it into memory (np.savez_compressed).
        with zf.open(info) as f:
            return np.lib.format.read_array(f, allow_pickle=False)
    header = bytes(memoryview(buf)[info.header_offset : info.header_offset + _LOCAL_HEADER.size])
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        raise ValueError(f"{what}: bad zip local header")
    return npy_view(buf, info.header_offset + _LOCAL_HEADER.size + name_len + extra_len, what)


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
        with zipfile.ZipFile(path) as zf:
            x = _npz_member(zf, buf, x_key, path)
            y = _npz_member(zf, buf, y_key, path)
        super().__init__(x, y, sample_shape, num_classes)

    def __reduce__(self) -> tuple[type, tuple]:
        return NpzDataset, self._args
