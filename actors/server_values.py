"""Where a server's values go for the workers on other nodes after each update: into the object
store (one object, or one per reader node), or pushed to a mirror on each reader node over a
TCP connection of its own (``topology.reduce: hosts``, :mod:`.mirrors`). Workers on the
server's own node read its shared buffer and need neither."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .protocol import Pushed
from .tcp import Outbox, PeerLost
from .wire import encode


class ValueReaders:
    """A server's readers on other nodes, and what it last handed them (:attr:`published`:
    an object-store ref, refs by node, a :class:`~.protocol.Pushed`, or None)."""

    def __init__(self, index: int, wire: str) -> None:
        self.index, self.wire = index, wire
        self.remote = False
        self.nodes: list[str] | None = None
        self.pushes: list[tuple[str, int, bytes]] | None = None
        self.published: Any = None
        self.outbox = Outbox()

    def set(
        self, remote: bool, nodes: list[str] | None, pushes: list[tuple[str, int, bytes]] | None
    ) -> None:
        """Whether some reader sits on another node; ``nodes``: the readers' nodes, each to
        get a copy of its own; ``pushes``: instead, the inbox on each of them to push to."""
        self.remote, self.nodes, self.pushes = remote, nodes, pushes

    def publish(
        self, slices: Sequence[np.ndarray], flat: np.ndarray, version: int, check: Callable
    ) -> Any:
        """Hand the values (``slices`` in the server's order, ``flat`` its whole buffer) to
        the readers elsewhere, as they are after ``version`` updates.

        Published: one object, or (``nodes``) one per reader node. A node pulls an object from
        any node that holds a copy, as Ray chooses, so one object read by several nodes is
        sometimes sent on by a reader's node (measured on emulated hosts: a host sent up to
        24% more than its share); a copy per node is sent from here only.

        Pushed: to each inbox in turn, in the order given (:meth:`.tcp.Outbox.send`). A
        reader node that cannot be reached is left out: its worker's loss is the stub's to
        find (its next call there fails, or the driver finds its host silent), and a worker
        waiting for values that never come reports this server lost."""
        if not self.remote:
            return None
        if self.pushes:
            to = self.pushes
            frames = [encode(slices, self.wire)] * len(to)
            with contextlib.suppress(PeerLost):
                self.outbox.send(to, 0, version, self.index, frames, check)
            self.published = Pushed(version)
            return self.published
        import ray  # noqa: PLC0415

        # by slices, rounded as they cross (actors.wire) under bf16; float32 as it is (Ray
        # copies it into its store as it puts it)
        snap: Any = flat if self.wire == "f32" else encode(slices, self.wire)
        nodes = self.nodes
        self.published = {n: ray.put(snap) for n in nodes} if nodes else ray.put(snap)
        return self.published

    def close(self) -> None:
        self.outbox.close()
