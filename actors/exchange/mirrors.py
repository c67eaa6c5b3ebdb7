"""A node's copies of the servers' values in a group summed by hosts (``topology.reduce:
hosts``): after each update, each server pushes its values over a TCP connection of its own
(:mod:`.tcp`) to one worker on each other node that reads them, whose inbox receives them
straight into shared memory there. Every worker of that node reads the mirror as it reads a
server on its own node, once the mirror holds the version the stub names
(:class:`~.protocol.MirrorAt`).

Each server has two mirrors on a node, taken in turn: the values after an even count of updates
go to the first, after an odd count to the second. A mirror names its values by their version
and their generation (:func:`~.protocol.mirror_seq`), which a server draws anew whenever its
values change other than by an update: after a reload, what a mirror held before is never read
as the same version of the new values. So a version crosses into the mirror no
worker reads while the workers still read the version before, and the kernel writes its bytes
where they are read, with no copy kept aside. A worker can be at most one version behind:
a server's next update waits for every worker of the step (it waits for the blocks' sums,
which wait for their workers), so once the first part of version ``v + 1`` crosses, no worker
reads version ``v - 1`` any more. Under ``wire: bf16`` a mirror holds the values as they
crossed, rounded: the bits a worker beside the server reads (:func:`.wire.rounded`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from raysinga.kernels.precision import from_bf16_bits

from ..common.buffers import SEQ, Attachments, Layout, SharedBuffer, with_seq
from ..common.errors import ActorLost
from ..common.protocol import MirrorAt, ServerAt, node_ip
from ..common.seqwait import sleep_while, wake
from .tcp import Inbox
from .wire import DELTA, Span, apply_delta, parts_of

WAIT_S = 60.0  # values that have not come by then were lost on the way: the server is lost
CHECK_S = 0.05  # how often a wait for values looks for an abort


class Mirrors:
    """A worker's mirrors of every server, two each (used where it is its node's first
    worker), and the inbox that fills them."""

    def __init__(self, tag: str, layouts: Sequence[Layout], node: str, host: str) -> None:
        self.layouts = list(layouts)
        self.bufs = [
            tuple(SharedBuffer(f"{tag}-m{k}{side}", with_seq(lay), node) for side in "ab")
            for k, lay in enumerate(layouts)
        ]
        for pair in self.bufs:
            for b in pair:
                b.arrays[SEQ][0] = -1  # holds no version yet
        self.plans = [parts_of(lay) for lay in layouts]  # as each server's values cross
        # by server: the (version, kind) whose parts are in, and those parts by index
        self._parts: list[tuple[Any, dict[int, list[np.ndarray]]]] = [(None, {}) for _ in layouts]
        self.inbox = Inbox(host, sink=self._fill, place=self._place)

    @classmethod
    def of(cls, spec: Any, layouts: Sequence[Layout], node: str) -> Mirrors | None:
        """A worker's (of :class:`~.protocol.WorkerSpec` ``spec``), where its spec asks."""
        if not spec.mirrors:
            return None
        return cls(f"{spec.tag}-g{spec.group}w{spec.index}", layouts, node, node_ip())

    def describe(self) -> dict[str, Any]:
        """Where the servers push to, and each server's two mirrors' handles."""
        handles = [tuple(b.handle() for b in pair) for pair in self.bufs]
        return {"contact": self.inbox.contact, "handles": handles}

    def _span(self, k: int, part: int, parts: int, j: int) -> Span | None:
        """Array ``j`` of part ``part`` of server ``k``'s values, where those are a part of
        its plan (else None: nothing of it is taken in)."""
        if not 0 <= k < len(self.bufs):
            return None
        plan = self.plans[k]
        if parts != len(plan) or not 0 <= part < parts or not 0 <= j < len(plan[part]):
            return None
        return plan[part][j]

    def _place(
        self,
        kind: int,
        version: int,
        k: int,
        part: int,
        parts: int,
        j: int,
        dtype: np.dtype,
        shape: tuple[int, ...],
    ) -> np.ndarray | None:
        """Where array ``j`` of a part of server ``k``'s values is received: in place in the
        mirror of ``version`` (which stops naming a version first), where it crosses as
        float32 values; a difference or bfloat16 words are received aside and written by
        :meth:`_fill`."""
        span = self._span(k, part, parts, j)
        if kind == DELTA or dtype != np.float32 or span is None or version < 0:
            return None
        name, lo, hi = span
        if math.prod(shape) != hi - lo:
            return None
        buf = self.bufs[k][version % 2]
        buf.arrays[SEQ][0] = -1  # no version while its bytes change
        return buf.arrays[name].reshape(-1)[lo:hi]

    def _fill(
        self, kind: int, version: int, k: int, part: int, parts: int, arrays: list[np.ndarray]
    ) -> None:
        """Part ``part`` of server ``k``'s values after ``version`` updates, as they crossed
        (:func:`.wire.parts_of`; ``version`` as :func:`~.protocol.mirror_seq` names it, its
        generation above the update count, which alone picks the mirror), noted until every
        part is in; then the version of its mirror (a reader waits for it before it reads).
        The parts crossed into the mirror (:meth:`_place`), save those that must be written:
        bfloat16 words, widened, and differences. A server sends the parts in order, so a
        first part starts the version anew: an update the server took back
        (:meth:`~.server.ParamServer._update`) never names a version, and its next parts
        write over it.

        ``kind`` :data:`.wire.DELTA`: the parts are the difference from the version before,
        which the other mirror must hold whole, of the same generation, to apply them (the
        server sends a difference only where it pushed that version whole); where it does
        not, the version is not taken in, and a reader waiting for it reports the server lost
        (:func:`wait_for`)."""
        spans = [self._span(k, part, parts, j) for j in range(len(arrays))]
        if not spans or None in spans or len(spans) != len(self.plans[k][part]):
            return
        if any(a.size != b - lo for a, (_, lo, b) in zip(arrays, spans, strict=True)):
            return
        kept, got = self._parts[k]
        if part == 0 or kept != (version, kind):
            got = {}
            self._parts[k] = ((version, kind), got)
        got[part] = arrays
        if len(got) < parts:
            return
        buf, base = self.bufs[k][version % 2], self.bufs[k][(version - 1) % 2]
        self._parts[k] = (None, {})
        if kind == DELTA and int(base.arrays[SEQ][0]) != version - 1:
            return  # not the version the difference is from: nothing it can be applied to
        buf.arrays[SEQ][0] = -1
        for c in range(parts):
            for (name, lo, hi), a in zip(self.plans[k][c], got[c], strict=True):
                dst = buf.arrays[name].reshape(-1)[lo:hi]
                if kind == DELTA:
                    apply_delta(dst, a.reshape(-1), base.arrays[name].reshape(-1)[lo:hi])
                elif a.dtype == np.uint16:
                    dst[...] = from_bf16_bits(a).reshape(-1)
                elif a.ctypes.data != dst.ctypes.data:  # not received in place
                    dst[...] = a.reshape(-1)
        buf.arrays[SEQ][0] = version
        wake(buf.arrays[SEQ])

    def close(self) -> None:
        self.inbox.close()
        for pair in self.bufs:
            for b in pair:
                b.close()


def first_on_each_node(infos: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The first of the workers ``infos`` (their ``describe()`` answers, in worker order) on
    each node, by node: the one whose mirrors every worker of that node reads."""
    firsts: dict[str, dict[str, Any]] = {}
    for w in infos:
        firsts.setdefault(w["node"], w)
    return firsts


def wait_for(maps: Attachments, at: MirrorAt | ServerAt, check: Callable[[], None]) -> None:
    """Until the mirror ``at`` names holds its version (or, a :class:`ServerAt`, the server's
    own buffer: its sequence lock counts two per update), asleep on its counter
    (:mod:`.seqwait`); ``check`` runs every :data:`CHECK_S` meanwhile (it raises to give up).
    Values that do not come within :data:`WAIT_S` were lost on the way: their server is
    reported lost (the run restarts its roles from the newest checkpoint)."""
    seq = maps.views(at.handle)[SEQ]
    want = 2 * at.version if isinstance(at, ServerAt) else at.seq
    end = time.monotonic() + WAIT_S
    while (now := int(seq[0])) != want:
        if time.monotonic() > end:
            raise ActorLost(
                "server",
                at.server,
                None,
                f"its values after update {at.version} did not reach this node in {WAIT_S:g} s",
            )
        check()
        sleep_while(seq, now, CHECK_S)
