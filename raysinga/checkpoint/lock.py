"""The run directory's writer lock: one process writes, prunes and recovers checkpoints there.

Only the lock holder may remove temporary directories or finish a replace cut short
(:func:`.manage.recover`): anyone else could take a live writer's work for a crash's leftovers.
"""

from __future__ import annotations

import fcntl
import os
import socket

from .format import CheckpointError
from .storage import Location, exists, read_bytes, write_bytes


class RunLock:
    """One writer per run directory: ``.writer.lock`` holds the writer's host and pid.

    On a local filesystem a lock left by a dead process of this host is taken over; elsewhere a
    stale lock must be removed by hand (the error says which file).
    """

    def __init__(self, root: Location) -> None:
        self.root, self.file = root, root.join(".writer.lock")
        self.owner = f"{socket.gethostname()} {os.getpid()}"
        self.held = False

    def acquire(self) -> RunLock:
        self.root.fs.create_dir(self.root.path, recursive=True)
        if self.root.local:
            self._acquire_local()
        else:
            if exists(self.file):
                raise CheckpointError(self._busy(read_bytes(self.file).decode(errors="replace")))
            write_bytes(self.file, self.owner.encode())
        self.held = True
        return self

    def _acquire_local(self) -> None:
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
                holder = open(self.file.path).read().strip()
            except FileNotFoundError:
                holder = None
            if holder is not None:
                host, _, pid = holder.partition(" ")
                if not (host == socket.gethostname() and pid.isdigit() and not _alive(int(pid))):
                    raise CheckpointError(self._busy(holder))
                # else: its writer died without letting go; the rename below replaces it
            tmp = f"{self.file.path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(self.owner)
            os.rename(tmp, self.file.path)
        finally:
            os.close(guard)  # also releases the flock

    def _busy(self, holder: str) -> str:
        return (
            f"{self.root}: another writer holds this run directory ({holder}); if it is "
            f"gone, remove {self.file}"
        )

    def release(self) -> None:
        if self.held and exists(self.file):
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
