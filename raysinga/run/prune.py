"""Pruning old checkpoints off the training path.

Deleting a checkpoint can take longer than writing its small files: here, unlinking one 768 MiB
shard took 117 ms (ext4 mounted with ``discard`` trims the freed blocks as the file goes), and
an object store deletes object by object. A run prunes after each commit on a thread of its own
while training goes on; whatever next lists or stages checkpoints in the run's directory (the
next checkpoint, a restart, the end of the run) waits for it first (:meth:`settle`), so that a
prune never meets a half-made checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class BackgroundPrune:
    """One prune at a time, on a thread started at the first; its failure is raised by the
    next :meth:`settle`, as it would have been raised by the commit that started it."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._running: Future[None] | None = None

    def start(self, prune: Callable[[], None]) -> None:
        """Run ``prune()`` in the background, once the previous one is done."""
        self.settle()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-prune")
        self._running = self._pool.submit(prune)

    def settle(self) -> None:
        """Wait for the prune under way, if any; raise its error."""
        if self._running is not None:
            running, self._running = self._running, None
            running.result()

    def close(self, tell: Callable[[str], None] | None = None) -> None:
        """Wait for the prune under way and stop the thread. A failure is raised, or, with
        ``tell`` (a run that failed already: its own error is what counts), told through it."""
        try:
            self.settle()
        except Exception as e:
            if tell is None:
                raise
            tell(f"raysinga: pruning old checkpoints failed: {e}")
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
