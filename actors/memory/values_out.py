"""Where a server's values go for the workers on other nodes after each update: into the object
store (one object, or one per reader node), or pushed to a mirror on each reader node over a
TCP connection of its own (``topology.reduce: hosts``, :mod:`.mirrors`). Workers on the
server's own node read its shared buffer and need neither."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..common.protocol import Pushed, mirror_seq
from ..exchange.tcp import Outbox, PeerLost, payload_bytes
from ..exchange.wire import DELTA, WHOLE, Span, cut, delta_frame, encode, frame, words


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
        self.pushing = 0  # bytes of the update being pushed, to all reader nodes
        self.generation = 0  # of the values pushed (.protocol.mirror_seq): new at each forget
        # each reader's inbox (its contact) -> the version it was last pushed whole, every
        # part; and the readers that had every part of the push under way
        self.based: dict[tuple[str, int, bytes], int] = {}
        self._whole: set[tuple[str, int]] = set()
        self.outbox = Outbox()

    def set(
        self, remote: bool, nodes: list[str] | None, pushes: list[tuple[str, int, bytes]] | None
    ) -> None:
        """Whether some reader sits on another node; ``nodes``: the readers' nodes, each to
        get a copy of its own; ``pushes``: instead, the inbox on each of them to push to."""
        self.remote, self.nodes, self.pushes = remote, nodes, pushes
        self.forget()  # (rewired: readers replaced, or the values reloaded)

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

        # by slices, rounded as they cross (actors.exchange.wire) under bf16; float32 as it is (Ray
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
        before: Sequence[np.ndarray] | None = None,
    ) -> None:
        """Part ``part`` of the values after ``version`` updates (``arrays``: its ranges in
        :attr:`parts`) to every reader node's inbox, where they are pushed;
        a mirror takes the version in once every part is in. A reader that cannot be reached
        is added to ``skip`` and gets no more parts of this update (as in :meth:`publish`).

        ``before``: the same ranges after ``version - 1`` updates. Under ``wire: *+zstd`` or
        ``*+delta``, a reader known to hold that version whole (:attr:`based`) is sent the
        difference of the words (:func:`.wire.delta_frame`), which compresses to far fewer
        bytes; any other the values themselves."""
        if not (self.remote and self.pushes):
            return
        to = [c for c in self.pushes if (c[0], c[1]) not in skip]
        if part == 0:
            self.pushing, self._whole = 0, {(c[0], c[1]) for c in to}
            self.outbox.keep_only(self.pushes)  # readers replaced since: dropped
        on_base = [c for c in to if before is not None and self.based.get(tuple(c)) == version - 1]
        rest = [c for c in to if c not in on_base]
        parts = len(self.parts)
        for group, kind in ((on_base, DELTA), (rest, WHOLE)):
            if not group:
                continue
            # compressed once for all the readers it goes to
            out = (
                frame(arrays, self.wire)
                if kind == WHOLE
                else delta_frame(arrays, before, self.wire)
            )
            self.pushing += payload_bytes(out) * len(group)
            try:
                self.outbox.send(
                    group, kind, mirror_seq(self.generation, version), self.index,
                    [out] * len(group), check, part, [parts] * len(group),
                )  # fmt: skip
            except PeerLost as e:  # the others had theirs
                skip.update(e.every)
                self._whole -= set(e.every)

    def pushed(self, version: int) -> Any:
        """Every part of the values after ``version`` updates went out (:meth:`push_part`):
        the readers that had every part hold that version whole."""
        whole = [c for c in self.pushes or () if (c[0], c[1]) in self._whole]
        self.based = {tuple(c): version for c in whole}
        nbytes = self.pushing // max(len(self.pushes or ()), 1)
        self.published = Pushed(version, nbytes, self.generation)
        return self.published

    def forget(self) -> None:
        """The values changed other than by an update (loaded, restored): no reader holds
        the version before the next one, and the next push sends the values whole, under a
        new generation (drawn at random: a server started anew draws its own), so that what
        a mirror held before never passes for the same version of the values now."""
        self.based = {}
        self.generation = secrets.randbits(30) + 1

    def close(self) -> None:
        self.outbox.close()
