"""Whole merged tensors out of a checkpoint, into formats other tools read."""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from .format import CheckpointError
from .reader import Checkpoint

_SAFETENSORS_DTYPE = {
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
}
FORMATS = ("safetensors", "npz")


def export(ck: Checkpoint, out: str, fmt: str, kind: str | None = "param") -> list[str]:
    """Write the checkpoint's tensors of ``kind`` (None: all) to ``out``; returns their names.
    The file appears whole or not at all (written beside it, then renamed)."""
    if fmt not in FORMATS:
        raise CheckpointError(f"export format must be one of {FORMATS}, got {fmt!r}")
    arrays = ck.arrays(kind)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        if fmt == "npz":
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
        else:
            _write_safetensors(
                tmp, arrays, {"step": str(ck.step), "format": "raysinga checkpoint export"}
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return list(arrays)


def _write_safetensors(path: str, arrays: dict[str, np.ndarray], meta: dict[str, str]) -> None:
    header: dict[str, object] = {"__metadata__": meta}
    off = 0
    for name, a in arrays.items():
        header[name] = {
            "dtype": _SAFETENSORS_DTYPE[str(a.dtype)],
            "shape": list(a.shape),
            "data_offsets": [off, off + a.nbytes],
        }
        off += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays.values():
            f.write(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
        f.flush()
        os.fsync(f.fileno())
