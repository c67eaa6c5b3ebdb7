"""The run directory's writer lock: one process writes, prunes and recovers checkpoints there.

Only the lock holder may remove temporary directories or finish a replace cut short
(:func:`.manage.recover`): anyone else could take a live writer's work for a crash's leftovers.

The lock is a lease. ``.writer.lock`` names its holder (host, pid, a token of its own) and the
time its lease ends; a thread of the holder renews it every third of the lease. A writer that
dies (``SIGKILL``, a lost machine) stops renewing, and once its lease has run out the next
writer takes the lock over, on a shared filesystem or an object store as on a local disk, with
nobody deleting a file by hand. A lock of a process of this host that is gone is taken over at
once. A live holder keeps renewing, so a second writer is refused; where the holder's clock
and ours disagree, a lease seen unrenewed for a whole lease period on our own clock counts as
run out too. A holder paused past its lease (SIGSTOP, a stalled machine) may find the lock
taken over when it wakes: it finds out at its next renewal, or at :meth:`RunLock.check`
before a commit, and stops instead of writing beside the new writer.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from .format import CheckpointError
from .storage import Location, exists, read_bytes, replace_bytes

LEASE_S = 15.0  # a writer that stops renewing loses the lock this long after its last renewal
SETTLE_S = 0.5  # on an object store: how long a taker waits before reading back who won
TORN_READS = 3  # on an object store: reads of a lock record cut short before it counts as garbage


class RunLock:
    """One writer per run directory, held as a lease renewed in the background."""

    def __init__(
        self, root: Location, lease_s: float = LEASE_S, notice: Callable[[str], None] | None = None
    ) -> None:
        """``notice``: told once when the lock waits for a gone writer's lease to run out."""
        self.notice = notice
        self.root, self.file = root, root.join(".writer.lock")
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.token = uuid.uuid4().hex
        self.lease_s = lease_s
        self.held = False
        self.lost: str | None = None  # why this holder no longer holds it, once it does not
        self._renewed = 0.0  # when this holder last renewed its lease (monotonic)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def owner(self) -> str:
        return f"{self.host} {self.pid}"

    def _record(self) -> bytes:
        until = time.time() + self.lease_s
        rec = {"host": self.host, "pid": self.pid, "token": self.token, "until": until}
        return json.dumps(rec).encode()

    # ------------------------------------------------------------------ taking it
    def acquire(self) -> RunLock:
        self.root.fs.create_dir(self.root.path, recursive=True)
        seen: dict[str, Any] = {}  # the holder's record as first read, and when
        while True:
            taken = self._try_local(seen) if self.root.local else self._try_remote(seen)
            if taken:
                break
            time.sleep(min(1.0, self.lease_s / 10))
        self.held = True
        self.lost = None
        self._renewed = time.monotonic()
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, name="run-lock", daemon=True)
        self._renewer.start()
        return self

    def _try_local(self, seen: dict[str, Any]) -> bool:
        # Check-and-create under an flock of the run directory itself: the kernel drops it when
        # its holder dies, so it is never stale, and two writers taking over one dead lock
        # cannot both win. The lock file appears whole (rename), so a writer killed while
        # taking it never leaves an empty one behind.
        guard = os.open(self.root.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            for name in os.listdir(self.root.path):  # left by writers killed mid-acquire
                if name.startswith(".writer.lock.tmp-"):
                    os.unlink(os.path.join(self.root.path, name))
            try:
                holder = open(self.file.path, "rb").read()
            except FileNotFoundError:
                holder = None
            if holder is not None and not self._free(holder, seen):
                return False
            replace_bytes(self.file, self._record())  # whole, as .writer.lock.tmp-<pid> first
            return True
        finally:
            os.close(guard)  # also releases the flock

    def _try_remote(self, seen: dict[str, Any]) -> bool:
        # An object store has no create-if-absent: write, wait, and read back who won (the
        # last writer of two racing takers; the other sees its token gone and backs off).
        held = self._read_remote()
        if held is not None and not self._free(held, seen):
            return False
        replace_bytes(self.file, self._record())
        time.sleep(SETTLE_S)
        return self._parse(read_bytes(self.file)).get("token") == self.token

    def _read_remote(self) -> bytes | None:
        """The lock's bytes on an object store (None: there is none). A record cut short is
        read again (up to ``TORN_READS`` times): a store that serves a read while the holder
        overwrites the lock may send part of the old body (moto does); the whole lock is
        what counts, and one that stays unreadable is reported as such."""
        for _ in range(TORN_READS):
            try:
                held = read_bytes(self.file) if exists(self.file) else None
            except FileNotFoundError:  # let go of between the two calls
                return None
            if held is None or "text" not in self._parse(held) or not held.startswith(b"{"):
                return held
            time.sleep(SETTLE_S / 5)
        return held

    def _free(self, data: bytes, seen: dict[str, Any]) -> bool:
        """Whether the lock recorded as ``data`` may be taken over; raises CheckpointError
        where a live writer holds it."""
        rec = self._parse(data)
        if rec.get("host") == self.host and isinstance(rec.get("pid"), int):
            if not _alive(rec["pid"]):
                return True  # its writer died without letting go
            raise CheckpointError(self._busy(rec))
        if "until" not in rec:  # no lease (an older raysinga, or garbage): never stale
            raise CheckpointError(self._busy(rec))
        now = time.monotonic()
        if seen.get("token") != rec.get("token") or seen.get("until") != rec["until"]:
            if seen:  # renewed, or taken by another writer meanwhile: alive
                raise CheckpointError(self._busy(rec))
            seen.update(token=rec.get("token"), until=rec["until"], at=now)
        if time.time() > rec["until"] or now - seen["at"] > self.lease_s:
            return True  # its lease ran out
        if self.notice is not None and not seen.get("told"):
            seen["told"] = True
            left = min(self.lease_s, rec["until"] - time.time())
            self.notice(
                f"raysinga: {self.file} is held by {rec.get('host')} {rec.get('pid')}; "
                f"waiting up to {left:.0f} s for it to renew its lease or to lose it"
            )
        return False  # not yet: wait for it to run out, or to be renewed

    @staticmethod
    def _parse(data: bytes) -> dict[str, Any]:
        text = data.decode(errors="replace").strip()
        with contextlib.suppress(ValueError):
            rec = json.loads(text)
            if isinstance(rec, dict) and isinstance(rec.get("until", 0), (int, float)):
                return rec
        host, _, pid = text.partition(" ")  # "host pid": a lock without a lease
        return {"host": host, "pid": int(pid)} if pid.isdigit() else {"text": text}

    def _busy(self, rec: dict[str, Any]) -> str:
        who = f"{rec['host']} {rec['pid']}" if "host" in rec else rec.get("text", "?")
        if "until" in rec:
            return (
                f"{self.root}: another writer holds this run directory ({who}) and renews "
                f"its lease in {self.file}; a writer that is gone loses it {self.lease_s:g} s "
                "after its last renewal"
            )
        return (
            f"{self.root}: another writer holds this run directory ({who}); if it is gone, "
            f"remove {self.file}"
        )

    # ------------------------------------------------------------------ holding it
    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                if self._taken_over():
                    return
                replace_bytes(self.file, self._record())  # also where it was deleted by hand
                self._renewed = time.monotonic()
            except OSError as e:  # storage unreachable for now: the next renewal tries again
                if time.monotonic() - self._renewed > self.lease_s:
                    self.lost = f"it could not be renewed for {self.lease_s:g} s ({e})"
                    return

    def _taken_over(self) -> bool:
        """Whether another writer holds the lock now (this one was paused past its lease:
        SIGSTOP, a stalled machine); records why in :attr:`lost`."""
        current = self._parse(read_bytes(self.file)) if exists(self.file) else None
        if current is None or current.get("token") == self.token:
            return False
        who = f"{current.get('host', '?')} {current.get('pid', '?')}"
        self.lost = f"{who} took it over after this writer's lease ran out"
        return True

    def check(self) -> None:
        """Raise CheckpointError where this holder has lost the lock: a writer must not
        commit or prune beside the one that took the run over. Where the last renewal is
        older than half a lease (this process may have been paused), the lock is read first."""
        if self.lost is None and time.monotonic() - self._renewed > self.lease_s / 2:
            with contextlib.suppress(OSError):  # unreachable: the commit itself will say so
                self._taken_over()
        if self.lost is not None:
            raise CheckpointError(
                f"{self.root}: this run lost its writer lock ({self.lost}); it stops without "
                "writing beside the run's new writer"
            )

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
            self._renewer = None
        if self.held and exists(self.file):
            with contextlib.suppress(OSError):
                if self._parse(read_bytes(self.file)).get("token") == self.token:
                    self.root.fs.delete_file(self.file.path)
        self.held = False

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
