"""Copies of the servers' state, and the log of the gradients applied since: what a lost server
is rebuilt from, with nothing rolled back.

A server takes a copy of its slices and optimizer state every few updates, on a helper thread
while the workers compute the next step (the next update waits for the copy if it is not done).
Its group's stub (the keeper) fetches each copy through a call it keeps waiting on the server
(:meth:`ServerCopies.next_copy`): the answer is owned by the stub and held by the stub's
process, so it outlives the server's process. The stub logs each step's summed, clipped
gradient while the servers apply it. A new server loads the newest copy and
applies the logged gradients since, in step order: the optimizer is deterministic, so it ends
with the lost server's bits.

A copy lost with the keeper (one node held both) leaves nothing to rebuild from: the run
restarts from its newest checkpoint.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .buffers import Attachments, Layout, SharedBuffer, shm_room
from .protocol import server_slices
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
        self, values: dict[str, np.ndarray], optimizer: dict[str, Any], version: int
    ) -> dict[str, Any]:
        """A copy of the values and the optimizer's state (its ``state_dict()``, with host
        arrays; the caller keeps both still meanwhile), or, shared, a note of its version once
        written into the buffer."""
        if self.shared and self.buffer is not None:
            self.buffer.write(values, optimizer, version)
            return {"version": version}
        return take_state(values, optimizer, version)

    def busy(self) -> bool:
        """Whether a copy is being taken now (a new one would be skipped)."""
        return self._taking is not None and not self._taking.done()

    def due(self, version: int) -> bool:
        return self.every > 0 and version - self.version >= self.every

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

    def __init__(self, tag: str, node: str, values: dict[str, np.ndarray], slot_names: Any) -> None:
        self.names = list(values)
        self.slot_names = tuple(slot_names)
        arrays: dict[str, tuple[tuple[int, ...], str]] = {"versions": ((self.SLOTS,), "int64")}
        arrays["meta_len"] = ((self.SLOTS,), "int64")
        for i in range(self.SLOTS):
            arrays[f"meta{i}"] = ((META_BYTES,), "uint8")
            for name, a in values.items():
                arrays[f"{i}/v/{name}"] = (a.shape, str(a.dtype))
                for slot in self.slot_names:
                    arrays[f"{i}/o/{name}/{slot}"] = (a.shape, str(a.dtype))
        self.buf = SharedBuffer(tag, Layout.of(arrays), node)
        self.arrays = self.buf.arrays
        self.arrays["versions"][:] = -1

    def handle(self) -> Any:
        return self.buf.handle()

    def write(self, values: dict[str, np.ndarray], optimizer: dict[str, Any], version: int) -> None:
        """Copy the values and the optimizer's state (its ``state_dict()``, host arrays; the
        caller keeps them still) into the slot not holding the newest."""
        v = self.arrays["versions"]
        i = int(np.argmin(v))
        v[i] = -1  # a half-written slot is never read
        for name in self.names:
            np.copyto(self.arrays[f"{i}/v/{name}"], values[name])
        st = optimizer
        for key, a in st["slots"].items():  # "<slice>/<slot>"; none yet for a slice not updated
            np.copyto(self.arrays[f"{i}/o/{key}"], a)
        meta = pickle.dumps({**st, "slots": sorted(st["slots"])})
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
        values = {
            k.split("/", 2)[2]: a.copy() for k, a in arrays.items() if k.startswith(f"{i}/v/")
        }
        slots = {key: arrays[f"{i}/o/{key}"].copy() for key in meta["slots"]}
        if int(v[i]) != version:  # written over meanwhile (the server still running)
            return None
        return {"version": version, "values": values, "optimizer": {**meta, "slots": slots}}


META_BYTES = 1 << 16  # a copy's description: the optimizer's name, hyperparameters, counts


def take_state(
    values: dict[str, np.ndarray], optimizer: dict[str, Any], version: int
) -> dict[str, Any]:
    """A copy of a server's slices (by slice name) and optimizer state (its ``state_dict()``,
    host arrays) at ``version``."""
    st = optimizer
    return {
        "version": version,
        "values": {k: a.copy() for k, a in values.items()},
        "optimizer": {**st, "slots": {k: np.array(a, copy=True) for k, a in st["slots"].items()}},
    }


class ReplayLog:
    """A stub's log of the summed gradients of its last steps, and its servers' newest copies.

    The log holds ``capacity`` steps in a ring of preallocated rows (the bound, in steps and
    bytes, is the run's ``fault.replay_steps`` and ``fault.replay_mb``); servers take a copy
    every ``capacity // 2`` updates, so the newest copy's steps are in the log."""

    def __init__(
        self, count: int, dtype: Any, capacity: int, tag: str, node: str = "", n_servers: int = 1
    ) -> None:
        """``tag`` names the rows' file in shared memory: servers on the stub's node that sum
        the workers' gradients themselves write each step's sum straight into its row (a
        :class:`~actors.protocol.SummedGrads`); with ``capacity`` 0 there is one, unlogged.
        Where shared memory lacks the room, the rows are the stub's own (``shared`` False).

        Each of the ``n_servers`` servers marks its slices of each row in the same file
        (``marks``): ``-2 - step`` while it writes step ``step``'s, ``step`` once written. A row
        holds a step when every server's mark names it."""
        self.capacity = capacity
        self.n_rows = max(1, capacity)
        layout = Layout.of(
            {"rows": ((self.n_rows, count), dtype), "marks": ((n_servers, self.n_rows), "int64")}
        )
        self._rows = SharedBuffer(tag, layout, node) if shm_room(layout.nbytes) else None
        self.shared = self._rows is not None
        arrays = (
            self._rows.arrays if self._rows else layout.views(np.zeros(layout.nbytes, np.uint8))
        )
        self.rows, self.marks = arrays["rows"], arrays["marks"]
        self.marks[...] = -1  # no row holds a step yet
        self.copies: dict[int, tuple[int, dict[str, Any]]] = {}  # server -> (version, copy)
        self._polls: dict[int, tuple[Any, Any]] = {}  # server -> (actor, its next_copy call)
        self._mapped: dict[int, tuple[str, dict[str, np.ndarray]]] = {}  # server -> its
        # CopyBuffer's file and arrays, mapped
        self._maps = Attachments()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def copy_every(self) -> int:
        return max(1, self.capacity // 2)

    @property
    def nbytes(self) -> int:
        return int(self.rows[0].nbytes) * self.capacity

    def handle(self) -> Any:
        return self._rows.handle() if self._rows is not None else None

    def record(self, step: int, flat: np.ndarray) -> None:
        """Log step ``step``'s summed gradient (before any server applies it)."""
        if self.capacity:
            np.copyto(self.begin(step), flat)
            self.commit(step)

    @property
    def steps(self) -> np.ndarray:
        """The step each row holds (-1: none whole)."""
        m = self.marks[:, : self.capacity]
        whole = (m == m[0]).all(axis=0) & (m[0] >= 0)
        return np.where(whole, m[0], -1)

    def begin(self, step: int) -> np.ndarray:
        """The row step ``step``'s sum is written into, marked as not logged until
        :meth:`commit` (a half-written row is never replayed)."""
        row = step % self.n_rows
        if self.capacity:
            self.marks[:, row] = -2 - step
        return self.rows[row]

    def commit(self, step: int) -> None:
        """Step ``step``'s row is whole: replay may use it."""
        if self.capacity:
            self.marks[:, step % self.n_rows] = step

    def drop_unfinished(self) -> None:
        """Unmark the rows a server began and did not finish (none is writing now): they hold
        no step."""
        self.marks[self.marks < -1] = -1

    def unfinished(self) -> int | None:
        """The step some server began writing into its row and did not finish (a server lost
        halfway through it), if any."""
        begun = self.marks[self.marks < -1]
        return int(-2 - begun.min()) if self.capacity and begun.size else None

    def attach(self, handles: dict[int, Any]) -> None:
        """Map each server's :class:`CopyBuffer` (by index; servers on this node), in place of
        the copies of the servers they replace: their copies are read from it when needed."""
        with self._lock:
            for k, handle in handles.items():
                self.copies.pop(k, None)
                self._polls.pop(k, None)
                self._unmap(k)
                self._mapped[k] = (handle.path, self._maps.views(handle))

    def collect(self, servers: dict[int, Any]) -> None:
        """Fetch each of ``servers``' copies (by index) from now on, in place of those of the
        servers they replace; a thread of this log's waits on them."""
        with self._lock:
            for k, actor in servers.items():
                self.copies.pop(k, None)
                self._unmap(k)
                self._polls[k] = (actor, self._poll(actor, -1))
        if self._thread is None:
            self._thread = threading.Thread(target=self._collect, name="copies", daemon=True)
            self._thread.start()

    @staticmethod
    def _poll(actor: Any, after: int) -> Any:
        return actor.next_copy.options(concurrency_group="copies").remote(after)

    def _collect(self) -> None:
        import ray  # noqa: PLC0415

        while not self._closed:
            with self._lock:
                waiting = {ref: k for k, (_, ref) in self._polls.items()}
            if not waiting:
                time.sleep(0.1)
                continue
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=0.5)
            for ref in ready:
                k = waiting[ref]
                try:
                    state = ray.get(ref)  # held here: it outlives the server and its node
                except ray.exceptions.RayError:
                    with self._lock:  # the server is gone: its newest copy stands
                        if self._polls.get(k, (None, None))[1] is ref:
                            del self._polls[k]
                    continue
                with self._lock:
                    actor, current = self._polls.get(k, (None, None))
                    if current is not ref:
                        continue  # that server was replaced meanwhile
                    if state is not None:
                        self.copies[k] = (int(state["version"]), state)
                    after = self.copies[k][0] if k in self.copies else -1
                    self._polls[k] = (actor, self._poll(actor, after))

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            with contextlib.suppress(RuntimeError):
                self._thread.join(timeout=1.0)
        with self._lock:
            self._mapped.clear()
            self._maps.close()
        self.rows = np.empty((0, self.rows.shape[1]), self.rows.dtype)  # no view keeps the map
        self.marks = np.empty((0, 0), np.int64)
        if self._rows is not None:
            self._rows.close()

    def sizes(self) -> dict[str, int]:
        with self._lock:
            copies = [c for _, c in self.copies.values()]
            mapped = [m for _, m in self._mapped.values() if int(m["versions"].max()) >= 0]
        held = sum(_nbytes(c) for c in copies) + sum(CopyBuffer.copy_nbytes(m) for m in mapped)
        count = len(copies) + len(mapped)
        return {"replay_log_bytes": self.nbytes, "copies": count, "copies_bytes": held}

    def _unmap(self, k: int) -> None:
        """Let server ``k``'s mapped copies go (the lock held): a replaced server's."""
        old = self._mapped.pop(k, None)
        if old is not None:
            self._maps.drop(old[0])

    def _copy(self, server: int) -> tuple[int, dict[str, Any]] | None:
        with self._lock:
            copy, mapped = self.copies.get(server), self._mapped.get(server)
        if mapped is not None:
            state = CopyBuffer.read(mapped[1])
            return None if state is None else (state["version"], state)
        return copy

    def plan(self, server: int, target: int | None) -> tuple[Any, list[int]] | None:
        """What server ``server`` is rebuilt from to reach version ``target`` (None: the step
        after the newest logged): its newest copy and the log rows of the steps since, in
        order; None where the copy is missing or the log no longer reaches back to it."""
        copy = self._copy(server)
        if copy is not None and target is None:
            target = max(copy[0], int(self.steps.max(initial=-1)) + 1)
        if copy is None or copy[0] > target:
            return None
        version, state = copy
        rows = []
        for step in range(version, target):
            row = step % self.capacity if self.capacity else -1
            if row < 0 or self.steps[row] != step:
                return None
            rows.append(row)
        return state, rows

    def rebuild(
        self,
        server: int,
        actor: Any,
        target: int | None,
        params: Layout,
        slices: Any,
        layout: Layout,
    ) -> int | None:
        """Bring ``actor``, a new server ``server``, to version ``target``: load the lost
        one's newest copy, then apply each logged step since, in order. Returns the number of
        steps replayed; None where there is nothing to rebuild from (:meth:`plan`)."""
        from .errors import get_all  # noqa: PLC0415

        plan = self.plan(server, target)
        if plan is None:
            return None
        source, rows = plan
        start = get_all([actor.load_copy.remote(source)], "server", indices=[server])[0]
        ups = [
            actor.update.remote(start + n, self.server_grads(row, params, slices, server, layout))
            for n, row in enumerate(rows)
        ]
        get_all(ups, "server", indices=[server] * len(ups))
        return len(rows)

    def server_grads(
        self, row: int, params: Layout, slices: Any, server: int, layout: Layout
    ) -> np.ndarray:
        """Server ``server``'s slices of a logged step (laid out by ``params``, as the stub's
        buffer), laid out by ``layout``, as the server's ``update`` takes them."""
        logged = params.views(self.rows[row].view(np.uint8))
        return server_slices(logged, slices, server, layout)


def _nbytes(state: Any) -> int:
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    return int(state.nbytes) if isinstance(state, np.ndarray) else 0
