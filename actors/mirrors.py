"""A node's copies of the servers' values in a group summed by hosts (``topology.reduce:
hosts``): after each update, each server pushes its values over a TCP connection of its own
(:mod:`.tcp`) to one worker on each other node that reads them, whose inbox writes them into
shared memory there, one mirror per server. Every worker of that node reads the mirror as it
reads a server on its own node, once the mirror holds the version the stub names
(:class:`~.protocol.MirrorAt`).

The order keeps a mirror from changing under a reader: a server pushes the values of an update
only once every worker of the step has computed (the update waits for the blocks' sums, which
wait for their workers). Under ``wire: bf16`` a mirror holds the values as they crossed,
rounded: the bits a worker beside the server reads (:func:`.wire.rounded`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from raysinga.kernels.precision import from_bf16_bits

from .buffers import SEQ, Attachments, Layout, SharedBuffer, with_seq
from .errors import ActorLost
from .protocol import MirrorAt, ServerAt, node_ip
from .seqwait import sleep_while, wake
from .tcp import Inbox
from .wire import DELTA, apply_delta, parts_of

WAIT_S = 60.0  # values that have not come by then were lost on the way: the server is lost
CHECK_S = 0.05  # how often a wait for values looks for an abort


class Mirrors:
    """A worker's mirrors of every server (used where it is its node's first worker) and the
    inbox that fills them."""

    def __init__(self, tag: str, layouts: Sequence[Layout], node: str, host: str) -> None:
        self.layouts = list(layouts)
        self.bufs = [
            SharedBuffer(f"{tag}-m{k}", with_seq(lay), node) for k, lay in enumerate(layouts)
        ]
        for b in self.bufs:
            b.arrays[SEQ][0] = -1  # holds no version yet
        self.plans = [parts_of(lay) for lay in layouts]  # as each server's values cross
        # by server: the (version, kind) whose parts are kept, and those parts by index
        self._parts: list[tuple[Any, dict[int, list[np.ndarray]]]] = [(None, {}) for _ in layouts]
        self.inbox = Inbox(host, sink=self._fill)

    @classmethod
    def of(cls, spec: Any, layouts: Sequence[Layout], node: str) -> Mirrors | None:
        """A worker's (of :class:`~.protocol.WorkerSpec` ``spec``), where its spec asks."""
        if not spec.mirrors:
            return None
        return cls(f"{spec.tag}-g{spec.group}w{spec.index}", layouts, node, node_ip())

    def describe(self) -> dict[str, Any]:
        return {"contact": self.inbox.contact, "handles": [b.handle() for b in self.bufs]}

    def _fill(
        self, kind: int, version: int, k: int, part: int, parts: int, arrays: list[np.ndarray]
    ) -> None:
        """Part ``part`` of server ``k``'s values after ``version`` updates, as they crossed
        (:func:`.wire.parts_of`), kept until every part is in; then all of them into its
        mirror, then the version (a reader waits for it before it reads). A server sends the
        parts in order, so a first part starts the version anew: the parts of an update the
        server took back (:meth:`~.server.ParamServer._update`) are never written.

        ``kind`` :data:`.wire.DELTA`: the parts are the difference from the version before,
        which the mirror must hold whole to apply them (the server sends a difference only
        where it pushed that version whole); where it does not, the version is not taken in,
        and a reader waiting for it reports the server lost (:func:`wait_for`)."""
        if not 0 <= k < len(self.bufs):
            return
        plan = self.plans[k]
        if parts != len(plan) or not 0 <= part < parts or len(arrays) != len(plan[part]):
            return
        if any(a.size != b - lo for a, (_, lo, b) in zip(arrays, plan[part], strict=True)):
            return
        kept, got = self._parts[k]
        if part == 0 or kept != (version, kind):
            got = {}
            self._parts[k] = ((version, kind), got)
        got[part] = arrays
        if len(got) < parts:
            return
        buf = self.bufs[k]
        self._parts[k] = (None, {})
        if kind == DELTA and int(buf.arrays[SEQ][0]) != version - 1:
            return  # not the version the difference is from: nothing it can be applied to
        for c in range(parts):
            for (name, lo, hi), a in zip(plan[c], got[c], strict=True):
                dst = buf.arrays[name].reshape(-1)[lo:hi]
                if kind == DELTA:
                    apply_delta(dst, a.reshape(-1))
                else:
                    dst[...] = (from_bf16_bits(a) if a.dtype == np.uint16 else a).reshape(-1)
        buf.arrays[SEQ][0] = version
        wake(buf.arrays[SEQ])

    def close(self) -> None:
        self.inbox.close()
        for b in self.bufs:
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
    want = 2 * at.version if isinstance(at, ServerAt) else at.version
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
