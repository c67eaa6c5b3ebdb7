"""A server's copies of itself: taken every few updates on a helper thread while the workers
compute, and handed to its group's stub (the keeper), what a lost server is rebuilt from
(:mod:`.replay`). A keeper on the server's node maps the copies' file (:class:`CopyBuffer`),
whose mapping outlives the server's process; one elsewhere fetches each copy through a call it
keeps waiting on the server (:meth:`ServerCopies.next_copy`). A server on its keeper's node
also notes there the order of its updates (which group's step each version applied), which a
rebuild of a server of asynchronous groups replays in.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..common.buffers import Layout, SharedBuffer
from .snapshots import CopyGate

POLL_S = 30.0  # how long a keeper's call waits on a server for its next copy


class ServerCopies:
    """One server's copies of itself, at most one being taken at a time; the newest is kept
    for its keeper to fetch."""

    def __init__(self) -> None:
        self.every = 0  # take a copy every this many updates (0: none)
        self.version = -1  # the version of the newest copy started
        self._io = ThreadPoolExecutor(1, thread_name_prefix="copy")
        self.gate = CopyGate()  # the next update waits for a copy being taken
        self._taking: Future[None] | None = None
        self._newest: dict[str, Any] | None = None
        self._cond = threading.Condition()
        self.buffer: CopyBuffer | None = None  # where copies go for a keeper on this node
        self.shared = False

    def keep(self, every: int, shared: bool, make_buffer: Callable[[], CopyBuffer]) -> Any:
        """Take a copy every ``every`` updates from now on. ``shared`` (the keeper is on this
        node): into the :class:`CopyBuffer` ``make_buffer`` makes (once), whose handle this
        returns for the keeper to map; else each copy is handed out by :meth:`next_copy`."""
        self.wait_for_copy()  # not while one is being taken
        self.shared = shared
        if shared and self.buffer is None:
            self.buffer = make_buffer()
        self.every = max(1, every)
        return self.buffer.handle() if shared and self.buffer is not None else None

    def take(
        self,
        values: dict[str, np.ndarray],
        optimizer: dict[str, Any],
        version: int,
        applied: dict[int, int] | None = None,
    ) -> dict[str, Any]:
        """A copy of the values and the optimizer's state (its ``state_dict()``, with host
        arrays; the caller keeps both still meanwhile) and of each group's last step applied,
        or, shared, a note of its version once written into the buffer."""
        if self.shared and self.buffer is not None:
            self.buffer.write(values, optimizer, version, applied)
            return {"version": version}
        return take_state(values, optimizer, version, applied)

    def note(self, version: int, group: int, step: int) -> None:
        """Update ``version`` applied group ``group``'s step ``step`` (noted in the shared
        buffer's ring, where there is one)."""
        if self.shared and self.buffer is not None:
            self.buffer.note(version, group, step)

    def busy(self) -> bool:
        """Whether a copy is being taken now (a new one would be skipped)."""
        return self._taking is not None and not self._taking.done()

    def due(self, version: int) -> bool:
        return self.every > 0 and version - self.version >= self.every

    def copy_now(
        self,
        version: int,
        optimizer: Any,
        applied: dict[int, int],
        values: dict[str, np.ndarray],
        gpu: Any = None,
    ) -> None:
        """Take a copy of a server's state at ``version`` in the background (its next update
        waits for it): its ``values`` (in its shared buffer already), its ``optimizer``'s state
        and each group's last step ``applied``. On a GPU (``gpu``, the server's device side)
        the optimizer slots come down to pinned host buffers of the copies' own on the
        device's copy stream, ordered after this update and before the next, which waits for
        them on the device; the helper thread waits for them before it writes the copy."""
        if self.busy():  # the pinned buffers are still being read: skip this one
            return
        state, on_device = optimizer.state_dict(), None
        if gpu is not None:
            state = {**state}
            state["slots"], on_device = gpu.snapshot_slots(state["slots"], "copies")

        def take() -> dict[str, Any]:
            if on_device is not None:
                on_device.synchronize()
            return self.take(values, state, version, applied)

        self.start(version, take)

    def start(self, version: int, take: Callable[[], dict[str, Any]]) -> None:
        """Copy the state (``take()``) in the background; the next update waits for the copy
        (:meth:`wait_for_copy`). Skipped while one is still being taken (the next update tries
        again)."""
        if self.busy():
            return
        self.gate.wait()
        self.version = version
        copied = self.gate.open()

        def run() -> None:
            try:
                state = take()
            finally:
                copied.set()
            with self._cond:
                self._newest = state
                self._cond.notify_all()

        self._taking = self._io.submit(run)

    def wait_for_copy(self) -> None:
        self.gate.wait()

    def next_copy(self, after: int) -> dict[str, Any] | None:
        """The newest copy once its version is past ``after`` (None after :data:`POLL_S`)."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._newest is not None and self._newest["version"] > after, POLL_S
            )
            newest = self._newest
        return newest if newest is not None and newest["version"] > after else None

    def close(self) -> None:
        self._io.shutdown(wait=False)
        if self.buffer is not None:
            self.buffer.close()


class CopyBuffer:
    """A server's copies of itself in shared memory, for a keeper on the server's node.

    Handing a copy over through Ray's object store cost the server about 20 ms of CPU for
    15 MB (the object's fresh pages faulted in, then filled), every few steps. Here the server
    writes each copy into one of two slots of a file in ``/dev/shm``, mapped once and reused,
    the older slot each time, so the newest whole copy is never the one being written. Each
    slot's version is -1 while it is written. The keeper maps the file when copies start
    (:meth:`ReplayLog.attach`), before any loss: its mapping, and the copies in it, outlive
    the server.
    """

    SLOTS = 2

    def __init__(
        self,
        tag: str,
        node: str,
        values: dict[str, np.ndarray],
        slot_names: Any,
        order_rows: int = 64,
    ) -> None:
        """``order_rows``: the updates the ring of :meth:`note` holds (more than are applied
        between two copies)."""
        self.names = list(values)
        self.slot_names = tuple(slot_names)
        arrays: dict[str, tuple[tuple[int, ...], str]] = {"versions": ((self.SLOTS,), "int64")}
        arrays["meta_len"] = ((self.SLOTS,), "int64")
        arrays["order"] = ((max(1, order_rows), 3), "int64")  # (version, group, step)
        for i in range(self.SLOTS):
            arrays[f"meta{i}"] = ((META_BYTES,), "uint8")
            for name, a in values.items():
                arrays[f"{i}/v/{name}"] = (a.shape, str(a.dtype))
                for slot in self.slot_names:
                    arrays[f"{i}/o/{name}/{slot}"] = (a.shape, str(a.dtype))
        self.buf = SharedBuffer(tag, Layout.of(arrays), node)
        self.arrays = self.buf.arrays
        self.arrays["versions"][:] = -1
        self.arrays["order"][...] = -1

    def handle(self) -> Any:
        return self.buf.handle()

    def write(
        self,
        values: dict[str, np.ndarray],
        optimizer: dict[str, Any],
        version: int,
        applied: dict[int, int] | None = None,
    ) -> None:
        """Copy the values and the optimizer's state (its ``state_dict()``, host arrays; the
        caller keeps them still), and each group's last step applied, into the slot not
        holding the newest."""
        v = self.arrays["versions"]
        i = int(np.argmin(v))
        v[i] = -1  # a half-written slot is never read
        for name in self.names:
            np.copyto(self.arrays[f"{i}/v/{name}"], values[name])
        st = optimizer
        for key, a in st["slots"].items():  # "<slice>/<slot>"; none yet for a slice not updated
            np.copyto(self.arrays[f"{i}/o/{key}"], a)
        meta = pickle.dumps({**st, "slots": sorted(st["slots"]), "applied": dict(applied or {})})
        if len(meta) > META_BYTES:
            raise ValueError(f"a server's copy needs {len(meta)} bytes of description")
        self.arrays[f"meta{i}"][: len(meta)] = np.frombuffer(meta, np.uint8)
        self.arrays["meta_len"][i] = len(meta)
        v[i] = version

    def close(self) -> None:
        self.buf.close()

    @staticmethod
    def copy_nbytes(arrays: dict[str, np.ndarray]) -> int:
        """The bytes of one copy (a slot's values and optimizer slots) in a mapped buffer."""
        return sum(a.nbytes for k, a in arrays.items() if k.startswith("0/"))

    @staticmethod
    def read(arrays: dict[str, np.ndarray]) -> dict[str, Any] | None:
        """The newest whole copy in a mapped buffer, as :func:`take_state` gives it (None if
        none was finished)."""
        v = arrays["versions"]
        i = int(np.argmax(v))
        version = int(v[i])
        if version < 0:
            return None
        meta = pickle.loads(arrays[f"meta{i}"][: int(arrays["meta_len"][i])].tobytes())
        applied = meta.pop("applied", {})
        values = {
            k.split("/", 2)[2]: a.copy() for k, a in arrays.items() if k.startswith(f"{i}/v/")
        }
        slots = {key: arrays[f"{i}/o/{key}"].copy() for key in meta["slots"]}
        if int(v[i]) != version:  # written over meanwhile (the server still running)
            return None
        return {
            "version": version,
            "values": values,
            "optimizer": {**meta, "slots": slots},
            "applied": applied,
        }

    def note(self, version: int, group: int, step: int) -> None:
        """Update ``version`` applied group ``group``'s step ``step``: its ring row, the
        version written last (a row cut short by a kill names an older version)."""
        row = self.arrays["order"][version % len(self.arrays["order"])]
        row[1], row[2] = group, step
        row[0] = version

    @staticmethod
    def order_since(arrays: dict[str, np.ndarray], version: int) -> list[tuple[int, int, int]]:
        """The updates noted after ``version``, in order, as ``(version, group, step)``: every
        one up to the newest noted. Raises LookupError where the ring no longer holds them all
        (then nothing exact can be replayed)."""
        order = arrays["order"]
        newest = int(order[:, 0].max(initial=-1))
        if newest <= version:
            return []
        if newest - version > len(order):
            raise LookupError(f"updates {version + 1} to {newest} no longer all in the ring")
        out = []
        for v in range(version + 1, newest + 1):
            row = order[v % len(order)]
            if int(row[0]) != v:
                raise LookupError(f"update {v} is not noted")
            out.append((v, int(row[1]), int(row[2])))
        return out


META_BYTES = 1 << 16  # a copy's description: the optimizer's name, hyperparameters, counts


def take_state(
    values: dict[str, np.ndarray],
    optimizer: dict[str, Any],
    version: int,
    applied: dict[int, int] | None = None,
) -> dict[str, Any]:
    """A copy of a server's slices (by slice name), optimizer state (its ``state_dict()``, host
    arrays) and each group's last step applied, at ``version``."""
    st = optimizer
    return {
        "version": version,
        "applied": dict(applied or {}),
        "values": {k: a.copy() for k, a in values.items()},
        "optimizer": {**st, "slots": {k: np.array(a, copy=True) for k, a in st["slots"].items()}},
    }
