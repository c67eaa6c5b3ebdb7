"""Words compressed without loss as they cross (``topology.wire: f32+zstd``, ``bf16+zstd``;
under ``f32+delta``, ``bf16+delta`` the values' differences alone, :mod:`.wire`): an array's
bytes regrouped by significance (every element's first byte, then every second byte, ...), so
that the sign and exponent bytes, which vary little from one element to the next, lie
together, then compressed with Zstandard (pyarrow's codec). A frame carries such an array
marked as compressed (:mod:`.tcp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

ZSTD_LEVEL = 1  # the fastest level: on a link slow enough to want it, the link waits, not this
WORDS = (np.dtype(np.float32), np.dtype(np.uint16))  # float32, bfloat16 words


@dataclass(frozen=True)
class Squeezed:
    """An array as it crosses compressed (:func:`squeeze`): its dtype, its shape and the
    compressed bytes."""

    dtype: np.dtype
    shape: tuple[int, ...]
    payload: np.ndarray  # uint8

    @property
    def nbytes(self) -> int:
        """The bytes it takes on the wire."""
        return self.payload.nbytes


def _codec() -> Any:
    import pyarrow as pa  # noqa: PLC0415 - only where a wire is compressed

    return pa.Codec("zstd", compression_level=ZSTD_LEVEL)


def squeeze(a: np.ndarray) -> Squeezed:
    """``a`` (float32 or bfloat16 words) compressed without loss to cross as it is: its bytes
    grouped by significance first, so that the sign and exponent bytes, which vary little from
    one element to the next, lie together."""
    a = np.ascontiguousarray(a)
    if a.dtype not in WORDS:
        raise ValueError(f"a frame carries float32 or bfloat16 words, not {a.dtype}")
    planes = np.empty((a.itemsize, a.size), np.uint8)
    for k, row in enumerate(_significance(a.reshape(-1).view(np.uint8), a.itemsize)):
        planes[k] = row  # one strided copy per byte of the word (as unsqueeze regroups)
    # np.frombuffer: a memoryview of the pyarrow Buffer itself can claim more bytes than it has
    return Squeezed(a.dtype, a.shape, np.frombuffer(_codec().compress(planes), np.uint8))


def unsqueeze(payload: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The array that :func:`squeeze` made ``payload`` of; ValueError where it is not one."""
    out = np.empty(shape, dtype)
    try:
        planes = _codec().decompress(payload, decompressed_size=out.nbytes)
    except Exception as e:  # pyarrow's ArrowIOError, or the wrong size
        raise ValueError(f"a compressed array that does not decompress: {e}") from None
    grouped = np.frombuffer(planes, np.uint8)
    if grouped.size != out.nbytes:
        raise ValueError("a compressed array of another size than its shape")
    grouped = grouped.reshape(dtype.itemsize, -1)
    for k, row in enumerate(_significance(out.reshape(-1).view(np.uint8), dtype.itemsize)):
        row[...] = grouped[k]  # a third of the time of assigning the transposed planes
    return out


def _significance(raw: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """Views of the bytes ``raw`` of ``itemsize``-byte words, one per byte of a word: every
    word's first byte, then every second byte, ..."""
    return [raw[k::itemsize] for k in range(itemsize)]
