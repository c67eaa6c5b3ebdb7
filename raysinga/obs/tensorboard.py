"""TensorBoard event files of a run's scalar metrics, written without TensorFlow or protobuf.

An event file is a sequence of TFRecords (length, masked CRC-32C of the length, payload, masked
CRC-32C of the payload), each payload one serialized ``tensorflow.Event`` protobuf. Scalars need
only four of its fields, so they are encoded here by hand:

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

Each numeric field of a metrics record becomes one scalar tagged ``<kind>/<field>``
(``train/loss``, ``eval/test_accuracy``, ``checkpoint/seconds``). Point TensorBoard at the runs'
parent directory (``tensorboard --logdir runs``) to see runs side by side.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

SUBDIR = "tensorboard"  # under the run directory
# the x axis, wall-clock instants and role identifiers: numbers that are not metrics
_SKIP = {"step", "time", "died", "index", "group"}


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum TFRecord framing uses."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    c = crc32c(data)
    return struct.pack("<I", (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 on the wire: negatives as two's complement
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, scalars: dict[str, float] | None = None) -> bytes:
    """One serialized Event: the file-version header when ``scalars`` is None."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step)
    if scalars is None:
        return out + _bytes_field(3, b"brain.Event:2")
    values = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", v))
        for tag, v in scalars.items()
    )
    return out + _bytes_field(5, values)


def record_scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The scalars of one metrics record, by tag."""
    kind = rec.get("kind", "metrics")
    return {
        f"{kind}/{k}": float(v)
        for k, v in rec.items()
        if k not in _SKIP and isinstance(v, int | float) and not isinstance(v, bool)
    }


class EventWriter:
    """Appends metrics records to a new event file in ``run_dir/tensorboard``.

    A run rewrites its metrics from its history each time it starts (as ``metrics.jsonl`` is
    rewritten), so the event files an earlier start of this run left there are removed first:
    TensorBoard would otherwise draw the steps before a resume twice."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = Path(run_dir) / SUBDIR
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.glob("events.out.tfevents.*.raysinga"):
            old.unlink()
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = self.dir / f"{name}.raysinga"
        self.file = self.path.open("wb")
        self._write(event(time.time()))

    def _write(self, payload: bytes) -> None:
        head = struct.pack("<Q", len(payload))
        self.file.write(head + _masked(head) + payload + _masked(payload))

    def record(self, rec: dict[str, Any]) -> None:
        scalars = record_scalars(rec)
        if scalars and isinstance(rec.get("step"), int):
            self._write(event(rec.get("time", time.time()), rec["step"], scalars))
            self.file.flush()

    def close(self) -> None:
        self.file.close()
