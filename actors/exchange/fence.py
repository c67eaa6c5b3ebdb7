"""The run's epoch: every message one role sends another carries it, so that a role replaced
while it was cut off cannot act once it is heard from again.

A host that is partitioned (its link down, its processes alive) looks lost to the run, which
replaces its roles on other hosts and goes on. When the link comes back, the old roles are
still running for a while (until Ray ends them): a stub may send a step's gradients to a
server, or ask a worker to compute a step into the buffer the new stub reads. The driver
raises the run's epoch at every recovery and tells every live role before training goes on
(:meth:`Fence.fence`); each role stamps its own epoch on what it sends and refuses what is
stamped with an older one (:meth:`Fence.admit`), counting what it refused so that the run can
say so in one line.
"""

from __future__ import annotations

import threading
from typing import Any


class Refused(RuntimeError):
    """A message from a role of an older epoch: it was replaced, and must not act."""


class Fence:
    """What a role knows of the run's epoch, and what it refused (a mixin of every role)."""

    def _fence_state(self) -> dict[str, Any]:
        state = self.__dict__.get("_fence")
        if state is None:
            state = self.__dict__.setdefault(
                "_fence", {"epoch": 0, "refused": [], "lock": threading.Lock()}
            )
        return state

    @property
    def epoch(self) -> int:
        """The epoch this role stamps on what it sends, and the oldest it takes."""
        return self._fence_state()["epoch"]

    def fence(self, epoch: int) -> int:
        """From now on, take nothing stamped older than ``epoch`` (the driver's call after a
        recovery, in the ``control`` group so that it reaches a busy role); returns how many
        messages were refused so far."""
        state = self._fence_state()
        with state["lock"]:
            state["epoch"] = max(state["epoch"], epoch)
            return len(state["refused"])

    def admit(self, epoch: int, what: str) -> None:
        """Raise :class:`Refused` for ``what`` (a message) stamped with an older epoch."""
        state = self._fence_state()
        if epoch >= state["epoch"]:
            return
        with state["lock"]:
            state["refused"].append(f"{what} (epoch {epoch} < {state['epoch']})")
        raise Refused(f"{what}: refused, sent in epoch {epoch} by a role replaced since")

    def refused(self) -> list[str]:
        """The messages refused so far, oldest first."""
        state = self._fence_state()
        with state["lock"]:
            return list(state["refused"])

    def alive(self) -> tuple[int, int]:
        """The run's heartbeat (``control`` group: answered while a step runs): the epoch and
        how many messages were refused so far."""
        state = self._fence_state()
        return state["epoch"], len(state["refused"])
