"""A parameter server's checkpoint copies and their background writes.

A checkpoint costs training only the copy of the server's state to memory: the copy is taken on
a helper thread while the workers compute the next step, the next update waits for it if it is
not done yet, and the copy is then written while training goes on. The memory copied into is
kept from one checkpoint to the next (already paged in: a fresh allocation would cost page
faults on every checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .shard import ShardImage, Tensors, check_and_write, copy_in_chunks

# The nice value of the thread that checks and writes a server's checkpoint copy, and of the
# hashing and writing threads it starts (a new thread takes its creator's): on a node whose
# cores the workers keep busy, a checkpoint's write takes the cores they leave, not theirs. The
# copy the next update waits for runs on the server's own threads, at their priority.
# RAYSINGA_CHECKPOINT_NICE=0 leaves them at the server's priority.
BACKGROUND_NICE = int(os.environ.get("RAYSINGA_CHECKPOINT_NICE", "10"))


def background_priority() -> None:
    """Lower this thread's priority to ``BACKGROUND_NICE`` (Linux: nice is per thread).
    Elsewhere, or where the system refuses, it stays as it is."""
    if BACKGROUND_NICE > 0 and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            tid = threading.get_native_id()
            os.setpriority(
                os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICE)
            )


class CopyGate:
    """An update's wait for a background copy of the state it is about to change: :meth:`open`
    (as the copy starts) gives the event the copy sets once taken, :meth:`wait` (before the
    update) waits for it and keeps the seconds it waited."""

    def __init__(self) -> None:
        self._copied: threading.Event | None = None
        self.waited = 0.0

    def open(self) -> threading.Event:
        self._copied, self.waited = threading.Event(), 0.0
        return self._copied

    def wait(self) -> None:
        if self._copied is None:
            return
        t0 = time.perf_counter()
        self._copied.wait()
        self._copied = None
        self.waited = time.perf_counter() - t0


# The longest a piece of a checkpoint's background work waits for the server's update under
# way (seconds): updates back to back (asynchronous groups) slow the write, never stop it.
PACE_WAIT_MAX = 0.5


class Snapshots:
    """One server's snapshots: at most one background write at a time.

    The background work after the copy (the finite check, the hashing, the writes, a few MiB
    at a time) waits while the server updates (:meth:`updating`, :meth:`pace`): the update is
    memory-bound and on the steps' path, the write is neither. It runs while the workers
    compute, when the server's cores would idle.

    ``pool``: the server's update threads, which copy large arrays in chunks (they are idle
    while a snapshot is copied: the next update waits for the copy).
    """

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self._io = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._low = ThreadPoolExecutor(
            1, thread_name_prefix="checkpoint-write", initializer=background_priority
        )
        self._writer: Future[dict[str, Any]] | None = None
        self._image: ShardImage | None = None  # the shard image copied into, reused
        self._preparing: Future[None] | None = None
        self._buffers: dict[tuple[str, int], np.ndarray] = {}  # plain copies, reused
        self.gate = CopyGate()  # the update after a snapshot waits for its copy
        self._quiet = threading.Event()  # set while no update runs
        self._quiet.set()
        self._update_s = 0.1  # how long the last update took (bounds a wait in pace())

    def prepare(self, placeholders: Tensors) -> None:
        """Lay out and map the shard image for tensors like ``placeholders`` in the
        background now, so that the first checkpoint costs no more than the later ones."""

        def prepare() -> None:
            with contextlib.suppress(ValueError):  # Arrow's layout cannot be used: plain copies
                self._image = ShardImage(placeholders)

        self._preparing = self._io.submit(prepare)

    def start(self, write: Callable[[threading.Event], dict[str, Any]]) -> None:
        """Run ``write(copied)`` in the background: it copies the state (see :meth:`copy`),
        sets ``copied`` and writes the copy, returning the shard's record. The previous write
        must have been joined (:meth:`join`) before the state was taken."""
        assert self._writer is None, "one background write at a time"
        copied = self.gate.open()

        def run() -> dict[str, Any]:
            try:
                return write(copied)
            finally:
                copied.set()  # whatever failed, the next update must not wait for ever

        self._writer = self._io.submit(run)

    def write(
        self,
        live: Tensors,
        version: int,
        tmp: Any,
        shard: int,
        compression: str | None,
        copied: threading.Event,
        on_device: Any = None,
    ) -> dict[str, Any]:
        """On the helper thread (:meth:`start`): copy ``live``, a server's shard at
        ``version``, setting ``copied`` once done (``on_device``: the CUDA event of its slots'
        copy from the device, waited for first), then check the copy and write it as shard
        ``shard`` of the checkpoint being made in ``tmp``. Returns the shard's record."""
        try:
            if on_device is not None:
                on_device.synchronize()
            tensors, image = self.copy(live, compression)
        finally:
            copied.set()  # updates may go on (after a failure too: it is reported at the end)
        pace = self.pace
        return self.behind(
            lambda: check_and_write(tensors, version, tmp, shard, compression, image, pace)
        )

    def behind(self, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``fn()`` on the low-priority thread (see ``BACKGROUND_NICE``), waited for: a write's
        part after its copy (the server's pool threads, which copy, never start from it)."""
        return self._low.submit(fn).result()

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Around an update: the background work pauses meanwhile (:meth:`pace`)."""
        t0 = time.perf_counter()
        self._quiet.clear()
        try:
            yield
        finally:
            self._quiet.set()
            self._update_s = min(time.perf_counter() - t0, PACE_WAIT_MAX)

    def pace(self) -> None:
        """Before each piece of a snapshot's background work: wait while an update runs, at
        most as long as the last one took."""
        self._quiet.wait(self._update_s)

    def wait_for_copy(self) -> None:
        """Before an update: the last snapshot's copy of the values must be taken first."""
        self.gate.wait()

    def copy(self, live: Tensors, compression: str | None) -> tuple[Tensors, ShardImage | None]:
        """Copies of ``live``, and the shard image they are in (None: plain buffers, as for
        compressed shards, which are not written from an image)."""
        image = self._image_for(live) if compression is None else None
        if image is not None:
            return image.place(live, self.pool), image
        return self._copies(live), None

    def _image_for(self, live: Tensors) -> ShardImage | None:
        """The image kept from the last checkpoint (or prepared at start) when its layout
        still fits ``live``, else a new one; None where Arrow's layout cannot be used."""
        if self._preparing is not None:
            self._preparing.exception()
            self._preparing = None
        if self._image is None or not self._image.fits(live):
            self._image = None
            try:
                self._image = ShardImage(live)
            except ValueError:
                return None
        return self._image

    def _copies(self, live: Tensors) -> Tensors:
        """Copies of ``live`` in the kept plain buffers, filled in chunks on the pool."""
        keys = [(i.name, i.start) for i, _ in live]
        if list(self._buffers) != keys or any(
            self._buffers[k].shape != a.shape or self._buffers[k].dtype != a.dtype
            for k, (_, a) in zip(keys, live, strict=True)
        ):
            self._buffers = {k: np.empty_like(a) for k, (_, a) in zip(keys, live, strict=True)}
        copy_in_chunks(
            [(self._buffers[k], a) for k, (_, a) in zip(keys, live, strict=True)], self.pool
        )
        return [(i, self._buffers[k]) for k, (i, _) in zip(keys, live, strict=True)]

    def result(self, wait: bool = True) -> dict[str, Any] | None:
        """The shard record of the background write (with ``update_waited``); None while it
        runs (``wait=False``). A failed write raises here."""
        if self._writer is None:
            raise RuntimeError("no checkpoint write was started")
        if not wait and not self._writer.done():
            return None
        fut, self._writer = self._writer, None
        return {**fut.result(), "update_waited": self.gate.waited}

    def join(self) -> None:
        """Wait for the background write, if any; its failure is reported by :meth:`result`
        (the driver asks for it), not here."""
        if self._writer is not None:
            fut, self._writer = self._writer, None
            fut.exception()

    def close(self) -> None:
        self.join()
        self._io.shutdown(wait=True)
        self._low.shutdown(wait=True)
