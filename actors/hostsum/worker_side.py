"""A block's sum of one step on its way to the servers (``topology.reduce: hosts``,
:mod:`.wire`): a leader's sum of its block's members, and the parts of a sum or of a lone
worker's gradient sent to each server's inbox over the block's own connections (:mod:`.tcp`),
the latter as its backward pass finishes them (:class:`EarlySends`). The stub's side of the
step is :mod:`.stub_side`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from raysinga.optim.grads import sum_into

from ..common.buffers import Attachments, Layout, ShmHandle
from ..common.errors import ActorLost
from ..common.protocol import BlockSend
from ..exchange.tcp import Outbox, PeerLost, payload_bytes
from ..exchange.wire import Span, cut, frame, parts_of
from ..memory.grads_in import own_slices

if TYPE_CHECKING:
    from ..common.slicing import Slice
    from ..memory.param_reader import ParamReader


class Worker(Protocol):
    """What a block's sum and its sends read of the worker that makes them
    (:class:`~raysinga.actors.worker.Worker`, which this module does not import: the role
    stands above what serves it)."""

    index: int
    slices: Sequence[Slice]  # the servers' slices of the parameters
    wire: str  # ``topology.wire``
    grads: Any  # its gradient buffer (:class:`~raysinga.actors.common.buffers.SharedBuffer`)
    reader: ParamReader
    block_sums: BlockSums
    computed: tuple[int, int] | None  # (epoch, step) of the gradient in its buffer

    def check_abort(self) -> None: ...

    def fetch(self, refs: list[Any]) -> list[Any]: ...

    def fetched(self, sources: tuple[Any, ...]) -> tuple[Any, ...]: ...


class BlockSums:
    """A block leader's own: the block's buffers on its node, mapped from one step to the
    next, the block's sum, reused, its connections to the servers, and how the servers'
    slices cross in parts (worked out once)."""

    def __init__(self) -> None:
        self.maps = Attachments()
        self.sum: dict[str, np.ndarray] = {}
        self.outbox = Outbox()
        self._plans: list[list[list[Span]]] | None = None
        self._needs: list[list[set[str]]] | None = None
        self._ranges: list[list[list[tuple[str, int, int]]]] | None = None

    def plans_of(self, layouts: Sequence[Layout]) -> list[list[list[Span]]]:
        """Each server's parts (:func:`.wire.parts_of` of its ``layouts``)."""
        if self._plans is None:
            self._plans = [parts_of(lay) for lay in layouts]
        return self._plans

    def needs_of(
        self, slices: Sequence[Slice], plans: list[list[list[Span]]]
    ) -> list[list[set[str]]]:
        """The parameters each server's each part holds slices of (:meth:`ranges_of`'s)."""
        if self._needs is None:
            ranges = self.ranges_of(slices, plans)
            self._needs = [[{p for p, _, _ in part} for part in parts] for parts in ranges]
        return self._needs

    def ranges_of(
        self, slices: Sequence[Slice], plans: list[list[list[Span]]]
    ) -> list[list[list[tuple[str, int, int]]]]:
        """The flat ranges of the parameters each server's each part holds: ``(param, start,
        stop)``."""
        if self._ranges is None:
            at = {s.name: (s.param, s.start) for s in slices}
            self._ranges = [
                [[(at[n][0], at[n][1] + a, at[n][1] + b) for n, a, b in part] for part in p]
                for p in plans
            ]
        return self._ranges

    def close(self) -> None:
        self.maps.close()
        self.outbox.close()


def summed_members(
    worker: Worker, step: int, epoch: int, members: tuple[Any, ...], done: tuple[Any, ...]
) -> tuple[Any, ...]:
    """What the leader ``worker`` sums of ``step``: ``members`` with those elsewhere fetched.
    Its own compute of the step came before (one caller's calls run in order) and must have
    ended well; the other members' results (``done``: refs, handed inside a tuple so that
    Ray sends the call at once) are waited for, abortably (a member's loss raises its error)."""
    if worker.computed != (epoch, step):
        raise RuntimeError(
            f"worker {worker.index} cannot sum step {step} of its block: its own compute of "
            "that step did not end well"
        )
    if done:
        worker.fetch(list(done))
    return worker.fetched(members)


def block_sum(
    worker: Worker,
    members: tuple[Any, ...],
    to: Sequence[tuple[str, int, bytes]],
    step: int,
    block: int,
    epoch: int,
) -> tuple[float, list[int]]:
    """The sum of a block's gradients of one step as its leader ``worker`` makes it:
    ``members`` in worker order, each the buffer of a member on this node or the snapshot
    of one elsewhere, sent to the servers (:class:`PartSender`). Returns the seconds it took
    and the bytes sent to each server."""
    t0 = time.perf_counter()
    mine, reader = worker.block_sums, worker.reader
    mine.maps.keep_only({m.path for m in members if isinstance(m, ShmHandle)})
    layout = worker.grads.layout
    views = [mine.maps.views(m) if isinstance(m, ShmHandle) else layout.views(m) for m in members]
    if len(views) == 1:
        own = own_slices(views[0], list(worker.slices))
    else:
        if not mine.sum:
            mine.sum = {p: np.empty(s, reader.dtype) for p, s in reader.shapes.items()}
        for p, out in mine.sum.items():
            sum_into(out, [v[p] for v in views])
        own = own_slices(mine.sum, list(worker.slices))
    sender = PartSender(worker, own, to, step, block, epoch)
    sender.send_rounds()
    return time.perf_counter() - t0, sender.result()


class PartSender:
    """A block's sum of one step (``own``: by slice name) on its way to the servers' inboxes
    (``to``, in server order): each server's slices of it (in its order, as they cross:
    :func:`.wire.encode`) in parts (:func:`.wire.parts_of`), each server's in order. Parts
    that go together go as a round, handed over from the server after this block on
    (:meth:`.tcp.Outbox.send`), so that one block goes into a server at once. A server that
    cannot be reached gets no more parts and is reported lost once the others have theirs
    (:meth:`result`)."""

    def __init__(
        self,
        worker: Worker,
        own: dict[str, np.ndarray],
        to: Sequence[tuple[str, int, bytes]],
        step: int,
        block: int,
        epoch: int,
    ) -> None:
        self.worker, self.own, self.to = worker, own, list(to)
        self.step, self.block, self.epoch = step, block, epoch
        self.plans = worker.block_sums.plans_of(worker.reader.layouts)
        self.turn = [(block + 1 + j) % len(to) for j in range(len(to))]
        self.sent, self.lost = [0] * len(to), set[int]()
        self.first: PeerLost | None = None
        self.next = [0] * len(to)  # each server's first part not sent yet
        worker.block_sums.outbox.keep_only(self.to)  # servers replaced since: dropped

    def send_rounds(self, may: Callable[[int, int], bool] = lambda k, c: True) -> None:
        """Every part not sent yet that ``may(server, part)`` lets go, each server's in order:
        the servers whose next part is the same go together, the lowest part first."""
        moved = True
        while moved:
            moved = False
            live = [k for k in self.turn if k not in self.lost]
            for c in sorted({self.next[k] for k in live if self.next[k] < len(self.plans[k])}):
                ks = [k for k in live if self.next[k] == c and may(k, c)]
                if ks:
                    self._send_round(c, ks)
                    for k in ks:
                        self.next[k] += 1
                    moved = True

    def _send_round(self, c: int, ks: list[int]) -> None:
        """Part ``c`` of servers ``ks``' slices (each can take the first parts of every block
        in and update them while the later ones cross)."""
        worker, plans = self.worker, self.plans
        frames = [frame(cut(self.own, plans[k][c]), worker.wire) for k in ks]
        try:
            worker.block_sums.outbox.send(
                [self.to[k] for k in ks],
                self.epoch,
                self.step,
                self.block,
                frames,
                worker.check_abort,
                part=c,
                parts=[len(plans[k]) for k in ks],
            )
        except PeerLost as e:  # the others had theirs; these get no more
            self.lost |= {k for k, t in enumerate(self.to) if (t[0], t[1]) in e.every}
            self.first = self.first or e
        for k, f in zip(ks, frames, strict=True):
            if k not in self.lost:
                self.sent[k] += payload_bytes(f)

    def result(self) -> list[int]:
        """The bytes sent to each server (what crossed: compressed under ``wire: *+zstd``);
        raises :class:`.errors.ActorLost` for the first server that could not be reached (its
        connection broke, its process or host is gone)."""
        if self.first is not None:
            where = self.first.where
            k = next(k for k, t in enumerate(self.to) if (t[0], t[1]) == where)
            raise ActorLost("server", k, None, f"its inbox: {self.first}") from None
        return self.sent


class EarlySends(PartSender):
    """A block of one worker's gradient of one step (``send``: :class:`.protocol.BlockSend`),
    sent as the worker computes it. The worker's backward pass reports each layer's gradients
    final (:meth:`ready`: a dense layer's before it computes its dx, which still reads its
    weights) and each layer done (:meth:`done`), the last layers first
    (:meth:`~raysinga.nn.model.Model.backward`). A server's part goes as soon as every
    parameter it holds a slice of is:

    - done, for a server on this worker's node (a worker there reads its values in place,
      and the server updates a part in place once every block's is in);
    - final, for a server on another node, a GEMM earlier: a worker there reads the server's
      values from a mirror, and the values after the update cross into the node's other
      mirror (:mod:`.mirrors`).

    A dense layer's weight gradient is computed by blocks of rows
    (:data:`raysinga.nn.layers.DW_ROW_BLOCKS`), and each block told final (:meth:`rows_final`,
    as a :class:`~raysinga.nn.layers.RowsHook`): a part for a server on another node goes once
    every range it holds is, without waiting for the rest of the GEMM. Each worker computes
    first the block that holds the slice of the server it sends to first (:meth:`first_block`), so
    that the blocks' first parts go to different servers, not all to one.

    The parts run from the last layers to the first (:func:`.wire.parts_of`), so the first
    parts cross the links while the first layers' gradients are still being computed. What
    is sent is what the whole buffer would send after the step: the same bytes."""

    def __init__(self, worker: Worker, send: BlockSend, step: int, epoch: int) -> None:
        own = own_slices(worker.grads.arrays, list(worker.slices))
        super().__init__(worker, own, send.to, step, send.block, epoch)
        self.needs = worker.block_sums.needs_of(worker.slices, self.plans)
        self.ranges = worker.block_sums.ranges_of(worker.slices, self.plans)
        self.starts = {(s.param, s.server): s.start for s in worker.slices}
        self.beside = send.beside or (True,) * len(send.to)  # (unknown: held as if beside)
        self.final: set[str] = set()  # the parameters whose gradients are final
        self.finished: set[str] = set()  # and those whose layers are done
        self.rows: dict[str, list[tuple[int, int]]] = {}  # final ranges of the others

    def first_block(self, key: str, bounds: Sequence[int]) -> int:
        """The block of ``key``'s gradient (cut at ``bounds``) to compute first: the one that
        holds the start of the slice of the first server, in this block's order of sending,
        that holds one on another node."""
        for k in self.turn:
            start = self.starts.get((key, k))
            if start is not None and not self.beside[k]:
                return max(i for i in range(len(bounds) - 1) if bounds[i] <= start)
        return 0

    def rows_final(self, key: str, start: int, stop: int) -> None:
        """Elements ``[start, stop)`` of parameter ``key``'s gradient are final in the
        worker's buffer: send every part now free to go."""
        self.rows.setdefault(key, []).append((start, stop))
        self.send_rounds(self._may)

    def ready(self, params: Iterable[str]) -> None:
        """``params``' gradients are final in the worker's buffer (their layer's dx may still
        read their values): send every part now free to go."""
        self.final.update(params)
        self.send_rounds(self._may)

    def done(self, params: Iterable[str]) -> None:
        """``params``' layer is done, dx included: send every part now free to go."""
        self.final.update(params)
        self.finished.update(params)
        self.send_rounds(self._may)

    def _may(self, k: int, c: int) -> bool:
        if self.beside[k]:
            return self.needs[k][c] <= self.finished
        return all(p in self.final or self._rows_in(p, a, b) for p, a, b in self.ranges[k][c])

    def _rows_in(self, param: str, start: int, stop: int) -> bool:
        """Whether elements ``[start, stop)`` of ``param``'s gradient are told final (by
        blocks, each a range of its own: a part's range may span two)."""
        at = start
        for a, b in sorted(self.rows.get(param, ())):
            if a <= at < b:
                at = b
            if at >= stop:
                return True
        return at >= stop

    def finish(self) -> list[int]:
        """The step's compute is done: the parts left go out; :meth:`result`."""
        self.send_rounds()
        return self.result()
