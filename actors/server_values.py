"""Where a server's values go for the workers on other nodes after each update: into the object
store (one object, or one per reader node), or pushed to a mirror on each reader node over a
TCP connection of its own (``topology.reduce: hosts``, :mod:`.mirrors`). Workers on the
server's own node read its shared buffer and need neither."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .protocol import Pushed
from .tcp import Outbox, PeerLost, payload_bytes
from .wire import Span, cut, encode, frame, words


class ValueReaders:
    """A server's readers on other nodes, and what it last handed them (:attr:`published`:
    an object-store ref, refs by node, a :class:`~.protocol.Pushed`, or None)."""

    def __init__(self, index: int, wire: str, parts: list[list[Span]]) -> None:
        self.index, self.wire = index, wire
        self.parts = parts  # as the values are pushed (:func:`.wire.parts_of`)
        self.remote = False
        self.nodes: list[str] | None = None
        self.pushes: list[tuple[str, int, bytes]] | None = None
        self.published: Any = None
        self.pushing = 0  # bytes of the update being pushed, to each reader node
        self.outbox = Outbox()

    def set(
        self, remote: bool, nodes: list[str] | None, pushes: list[tuple[str, int, bytes]] | None
    ) -> None:
        """Whether some reader sits on another node; ``nodes``: the readers' nodes, each to
        get a copy of its own; ``pushes``: instead, the inbox on each of them to push to."""
        self.remote, self.nodes, self.pushes = remote, nodes, pushes

    def publish(
        self, slices: dict[str, np.ndarray], flat: np.ndarray, version: int, check: Callable
    ) -> Any:
        """Hand the values (``slices`` by name in the server's order, ``flat`` its whole
        buffer) to the readers elsewhere, as they are after ``version`` updates.

        Published: one object, or (``nodes``) one per reader node. A node pulls an object from
        any node that holds a copy, as Ray chooses, so one object read by several nodes is
        sometimes sent on by a reader's node (measured on emulated hosts: a host sent up to
        24% more than its share); a copy per node is sent from here only.

        Pushed: in parts (:meth:`push_part`), to each inbox in turn, in the order given. A
        reader node that cannot be reached is left out: its worker's loss is the stub's to
        find (its next call there fails, or the driver finds its host silent), and a worker
        waiting for values that never come reports this server lost."""
        if not self.remote:
            return None
        if self.pushes:
            skip: set = set()
            for c, part in enumerate(self.parts):
                self.push_part(cut(slices, part), version, c, skip, check)
            return self.pushed(version)
        import ray  # noqa: PLC0415

        # by slices, rounded as they cross (actors.wire) under bf16; float32 as it is (Ray
        # copies it into its store as it puts it)
        snap: Any = flat if words(self.wire) == "f32" else encode(list(slices.values()), self.wire)
        nodes = self.nodes
        self.published = {n: ray.put(snap) for n in nodes} if nodes else ray.put(snap)
        return self.published

    def push_part(
        self,
        arrays: Sequence[np.ndarray],
        version: int,
        part: int,
        skip: set,
        check: Callable,
    ) -> None:
        """Part ``part`` of the values after ``version`` updates (``arrays``: its ranges in
        :attr:`parts`) to every reader node's inbox, where they are pushed;
        a mirror takes the version in once every part is in. A reader that cannot be reached
        is added to ``skip`` and gets no more parts of this update (as in :meth:`publish`)."""
        if not (self.remote and self.pushes):
            return
        to = [c for c in self.pushes if (c[0], c[1]) not in skip]
        out = frame(arrays, self.wire)  # compressed once, where it is
        frames = [out] * len(to)
        if part == 0:
            self.pushing = 0
        self.pushing += payload_bytes(out)
        try:
            self.outbox.send(
                to, 0, version, self.index, frames, check, part, [len(self.parts)] * len(to)
            )
        except PeerLost as e:  # the others had theirs
            skip.update(e.every)

    def pushed(self, version: int) -> Any:
        """Every part of the values after ``version`` updates went out (:meth:`push_part`)."""
        self.published = Pushed(version, self.pushing)
        return self.published

    def close(self) -> None:
        self.outbox.close()
