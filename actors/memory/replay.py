"""Copies of the servers' state, and the log of the gradients applied since: what a lost server
is rebuilt from, with nothing rolled back.

A server takes a copy of its slices and optimizer state every few updates (:mod:`.copies`), on
a helper thread while the workers compute the next step. Its group's stub (the keeper) maps the
copies' file, or fetches each copy through a call it keeps waiting on the server: either way
the copy outlives the server's process. The stub logs each step's summed, clipped
gradient while the servers apply it. A new server loads the newest copy and
applies the logged gradients since, in step order: the optimizer is deterministic, so it ends
with the lost server's bits.

A copy lost with the keeper (one node held both) leaves nothing to rebuild from: the run
restarts from its newest checkpoint.

Asynchronous groups each update every server, in an order only the server knows. A server on
its keeper's node also notes, after each update, which group's step it applied at which version
(:meth:`~.copies.CopyBuffer.note`, a ring in its copies' file, which the keeper maps): a new
server loads the newest copy and applies the logged gradients of every group's steps since,
each from its own group's stub, in the order the lost server applied them
(:meth:`ReplayLog.async_plan`), and so ends with the lost server's bits at its last update
noted.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np

from ..common.buffers import Attachments, Layout, SharedBuffer, shm_room
from ..common.protocol import server_slices
from .copies import CopyBuffer


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
        :class:`~actors.common.protocol.SummedGrads`); with ``capacity`` 0 there is one, unlogged.
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

    def async_plan(self, server: int) -> tuple[dict[str, Any], list[tuple[int, int, int]]] | None:
        """What server ``server`` of asynchronous groups is rebuilt from: its newest copy and
        the updates it noted since, ``(version, group, step)`` in order; None where its copies
        are not mapped here (a server on another node) or the ring no longer reaches back to
        the copy."""
        with self._lock:
            mapped = self._mapped.get(server)
        state = CopyBuffer.read(mapped[1]) if mapped is not None else None
        if state is None:
            return None
        try:
            return state, CopyBuffer.order_since(mapped[1], state["version"])
        except LookupError:
            return None

    def row_of(self, step: int) -> int | None:
        """The log's row holding step ``step`` whole, if any."""
        if not self.capacity:
            return None
        row = step % self.capacity
        return row if int(self.steps[row]) == step else None

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
        from ..common.errors import get_all  # noqa: PLC0415

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
