"""A synchronous group summed by hosts (``topology.reduce: hosts``, :mod:`.wire`): the
stub's step, and a block leader's sum.

Each worker computes its gradient into its shared-memory buffer. Each block's leader, once its
members are done, sums their buffers in worker order and sends each server its slices of the
sum over a TCP connection of its own (:mod:`.tcp`). Each server takes its slices of every block
in and sums them in block order (:meth:`~.server.ParamServer._update`). The stub only sends
the calls: no gradient passes through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from raysinga.optim.grads import sum_into

from .bells import step_record
from .buffers import Attachments, Layout, ShmHandle
from .errors import ActorLost, cancel, cancelled_on_failure, get_all
from .protocol import (
    BlockSend,
    HostFrames,
    MirrorAt,
    Published,
    Pushed,
    ServerAt,
    StepStats,
    worker_buffer_layout,
)
from .server_grads import own_slices
from .tcp import Outbox, PeerLost, payload_bytes
from .traffic import block_step_bytes
from .wire import Span, cut, frame, parts_of

if TYPE_CHECKING:
    from .slicing import Slice
    from .stub import Stub
    from .worker import Worker


def block_steps(stub: Stub, start: int, stop: int) -> list[StepStats]:
    """Steps ``start .. stop-1`` summed by blocks (``topology.reduce: hosts``, :mod:`.wire`):
    each worker computes; each block's leader, once its members are done, sums them and cuts
    the sum into the servers' slices and sends each its own (:mod:`.tcp`); each server takes
    its slices of every block in and sums them in block order. A block of one worker sends
    its gradient as it computes it, the last layers' first (:class:`EarlySends`), and needs no
    sum. A step's computes, sums and updates go out at once (a leader sums once its members
    are done, a server updates each part once every block's sum of it is in); this stub never
    touches a gradient.

    From a chunk's second step on, a step's calls go out before the step before is heard
    back: each worker reads the values it needs once they are in (:class:`~.protocol.MirrorAt`,
    :class:`~.protocol.ServerAt`, waited for asleep: :mod:`.seqwait`), so a step starts as the
    last values land, not one round trip to this stub later. Each step is computed from the
    same values as when it waits: a server changes its values only once every worker of the
    next step is done with them (its update waits for every block's sum). A chunk's first
    step is taken alone: the versions the servers hold are read off its answers (a chunk may
    follow a reload or a recovery).

    Where every block is one worker, the rest of the chunk goes out as one call per role
    (:func:`_at_once`): each worker loops over the steps, reading each step's values once
    they are in, and each server over its updates, taking each step's sums in from its
    inbox. The steps then cost no call each, on any core."""
    first = _dispatch(stub, start)
    records = [_collect(stub, first)]
    at = [v for v, _, _ in first.results]  # what the servers hold: what the next step reads
    ahead = all(
        stub.local_src[i][k] is not None or isinstance(stub.refs[k], Pushed)
        for i in range(len(stub.workers))
        for k in range(len(stub.servers))
    )
    if ahead and stop > start + 1 and all(len(m) == 1 for m in stub.blocks):
        return records + _at_once(stub, start + 1, stop, at)
    inflight: list[_Step] = []  # sent, not yet heard back: at most two steps
    try:
        for step in range(start + 1, stop):
            inflight.append(_dispatch(stub, step, at if ahead else None))
            at = [v + 1 for v in at]
            if len(inflight) == 2 or not ahead:
                records.append(_heard(stub, inflight.pop(0)))
        while inflight:
            records.append(_heard(stub, inflight.pop(0)))
    finally:
        for sent in inflight:  # a step before them failed: their calls are not waited for
            cancel(sent.calls())
    return records


class _Step:
    """One step's calls, in flight: when they went out, the servers' versions its workers
    read (None: as they were when it went out), and once heard back, the servers' answers."""

    def __init__(
        self, step: int, at: list[int] | None, t0: float, computes: list, sums: list, ups: list
    ) -> None:
        self.step, self.at, self.t0 = step, at, t0
        self.computes, self.sums, self.ups = computes, sums, ups
        self.results: list[tuple[int, Any, float]] = []

    def calls(self) -> list[Any]:
        return [c[0] for c in self.computes] + self.sums + self.ups


def _at_once(stub: Stub, start: int, stop: int, at: list[int]) -> list[StepStats]:
    """Steps ``start .. stop-1`` of a group whose blocks are one worker each, the servers
    holding the values after ``at`` updates: one call per worker
    (:meth:`~.worker.Worker.compute_steps`) and per server
    (:meth:`~.server.ParamServer.update_steps`), all sent at once. Each step reads the values
    the step before left; a server changes its values only once every block's sum of the step
    is in, so every worker of a step reads the same ones. Where a call fails the others are
    cancelled and the failure raised, as for a step's calls (a server waiting for a lost
    block's sums is aborted by the recovery, and puts back what it had updated)."""
    t0 = max(time.time(), stub.heard)
    n = len(stub.workers)
    sends = _alone(stub)
    computes = [
        w.compute_steps.remote(
            start, stop, i, n, *_sources(stub, i, at), epoch=stub.epoch, send=sends[i]
        )
        for i, w in enumerate(stub.workers)
    ]
    frames = HostFrames(stub.epoch, len(stub.blocks))
    ups = [s.update_steps.remote(start, stop, frames, stub.group, stub.epoch) for s in stub.servers]
    with stub._server_snapshots(), cancelled_on_failure(computes + ups):
        by_worker = get_all(computes, "worker", stub.group)
        by_server = get_all(ups, "server")
    nodes = [s["node"] for s in stub.server_infos]
    records = []
    for j, step in enumerate(range(start, stop)):
        stats = [w[j] for w in by_worker]
        done = [s[j] for s in by_server]
        versions = [v for v, _, _, _ in done]
        if versions != [v + j + 1 for v in at]:
            raise RuntimeError(
                f"step {step} read the servers' values after {[v + j for v in at]} updates "
                f"and left them after {versions}: the steps after it read the wrong ones"
            )
        published = stub._published_bytes()  # the values this step's workers read
        stub.refs = [ref for _, ref, _, _ in done]
        out = [stats[m[0]].pop("sent") for m in stub.blocks]
        traffic = block_step_bytes(stub.worker_nodes, stub.blocks, [0] * n, nodes, out, published)
        t1 = max(st["end"] for st in stats)
        t3 = max(t1, *(t for _, _, _, t in done))
        seconds = [sec for _, _, sec, _ in done]
        records.append(step_record(step, stats, t0, t1, t1, t3, seconds, None, traffic))
        t0 = t3
    stub.heard = time.time()
    return records


def _alone(stub: Stub) -> dict[int, BlockSend]:
    """What each worker that is a block of its own sends its gradient to as it computes it
    (:class:`EarlySends`), by worker."""
    to = tuple(s["inbox"] for s in stub.server_infos)
    return {
        m[0]: BlockSend(to, b, tuple(h is not None for h in stub.local_src[m[0]]))
        for b, m in enumerate(stub.blocks)
        if len(m) == 1
    }


def _dispatch(stub: Stub, step: int, at: list[int] | None = None) -> _Step:
    """Every call of ``step``: the workers' computes (reading the servers' values after
    ``at`` updates, where given; else as they are now), the leaders' sums, the servers'
    updates."""
    t0 = time.time()
    n = len(stub.workers)  # (one synchronous group: the servers' refs are this stub's)
    to = tuple(s["inbox"] for s in stub.server_infos)
    alone = _alone(stub)
    computes = [
        w.compute.options(num_returns=2).remote(
            step,
            i,
            n,
            stub.snapshot[i],
            *_sources(stub, i, at),
            epoch=stub.epoch,
            send=alone.get(i),
        )
        for i, w in enumerate(stub.workers)
    ]
    sums = []
    for b in (b for b, m in enumerate(stub.blocks) if len(m) > 1):
        members = stub.blocks[b]
        srcs = tuple(
            Published(computes[i][1]) if stub.snapshot[i] else stub.worker_handles[i]
            for i in members
        )
        # the other members' results, which the leader waits for (its own compute runs before
        # the sum: one caller's calls run in order): handed inside a tuple, not as arguments
        # of their own, which Ray would resolve before it sent the call. A member lost then
        # leaves the call unsent, and the leader's later calls wait behind the gap in its
        # order of calls (Ray cancels them after 30 s) although the leader lives on.
        done = tuple(computes[i][0] for i in members[1:])
        leader = stub.workers[members[0]]
        sums.append(leader.host_sum.remote(step, srcs, done, to=to, block=b, epoch=stub.epoch))
    # The servers' updates go out with the rest: each takes the blocks' sums in from its inbox
    # part by part as they come, updating and pushing a part while later ones cross, with no
    # wait for the sums' calls to be heard back here. A server waiting for a lost leader's sums
    # is aborted by the recovery, and puts back what it had updated (whole or not at all).
    frames = HostFrames(stub.epoch, len(stub.blocks))
    ups = [s.update.remote(step, frames, stub.group, stub.epoch) for s in stub.servers]
    return _Step(step, at, t0, computes, sums, ups)


def _sources(stub: Stub, i: int, at: list[int] | None) -> tuple[Any, ...]:
    """Worker ``i``'s sources of the servers' values: as :meth:`~.stub.Stub._sources`, or
    (``at``) those after ``at[k]`` updates of server ``k``, waited for where it reads them."""
    if at is None:
        return stub._sources(i)
    return tuple(
        ServerAt(h, at[k], k)
        if h is not None
        else MirrorAt(stub.mirror_src[i][k], at[k], k, stub.refs[k].generation)
        for k, h in enumerate(stub.local_src[i])
    )


def _heard(stub: Stub, sent: _Step) -> StepStats:
    """:func:`_collect`; where ``sent`` read values after given updates, the servers must
    hold one more each now (else the step after it, sent already, waits for values that
    never come: the step fails instead)."""
    record = _collect(stub, sent)
    after = [v for v, _, _ in sent.results]
    if sent.at is not None and after != [v + 1 for v in sent.at]:
        raise RuntimeError(
            f"step {sent.step} read the servers' values after {sent.at} updates and left them "
            f"after {after}: a step sent ahead would read the wrong ones"
        )
    return record


def _collect(stub: Stub, sent: _Step) -> StepStats:
    """Wait for ``sent``'s calls: the step's record. Where one fails, the others are
    cancelled (:func:`.errors.cancelled_on_failure`) and the failure raised."""
    published = stub._published_bytes()  # the values its workers read: the last step's
    summed = [b for b, m in enumerate(stub.blocks) if len(m) > 1]
    with stub._server_snapshots(), cancelled_on_failure(sent.calls()):
        stats = get_all([c[0] for c in sent.computes], "worker", stub.group)
        t1 = time.time()
        leaders = [stub.blocks[b][0] for b in summed]
        heard = get_all(sent.sums, "worker", stub.group, indices=leaders)
        t2 = time.time()
        sent.results = get_all(sent.ups, "server")
    by_block = dict(zip(summed, (to_each for _, to_each in heard), strict=True))
    out = [
        by_block[b] if b in by_block else stats[m[0]].pop("sent") for b, m in enumerate(stub.blocks)
    ]
    stub.refs = [ref for _, ref, _ in sent.results]
    snaps = [
        worker_buffer_layout(stub.shapes, stub.dtype, st).nbytes if snap else 0
        for snap, st in zip(stub.snapshot, stub.worker_state, strict=True)
    ]
    traffic = block_step_bytes(
        stub.worker_nodes,
        stub.blocks,
        snaps,
        [s["node"] for s in stub.server_infos],
        out,
        published,
    )
    seconds = [t for _, _, t in sent.results]
    # A step sent ahead counts from when the step before was heard back: the steps' times
    # add up to the time they took (the chunks are sized by them), a wait for values in
    # the step's fetch
    t0 = max(sent.t0, stub.heard)
    stub.heard = t3 = time.time()
    return step_record(sent.step, stats, t0, t1, t2, t3, seconds, None, traffic)


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

    def plans_of(self, layouts: Sequence[Layout]) -> list[list[list[Span]]]:
        """Each server's parts (:func:`.wire.parts_of` of its ``layouts``)."""
        if self._plans is None:
            self._plans = [parts_of(lay) for lay in layouts]
        return self._plans

    def needs_of(
        self, slices: Sequence[Slice], plans: list[list[list[Span]]]
    ) -> list[list[set[str]]]:
        """The parameters each server's each part holds slices of."""
        if self._needs is None:
            param = {s.name: s.param for s in slices}
            self._needs = [[{param[name] for name, _, _ in part} for part in p] for p in plans]
        return self._needs

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

    The parts run from the last layers to the first (:func:`.wire.parts_of`), so the first
    parts cross the links while the first layers' gradients are still being computed. What
    is sent is what the whole buffer would send after the step: the same bytes."""

    def __init__(self, worker: Worker, send: BlockSend, step: int, epoch: int) -> None:
        own = own_slices(worker.grads.arrays, list(worker.slices))
        super().__init__(worker, own, send.to, step, send.block, epoch)
        self.needs = worker.block_sums.needs_of(worker.slices, self.plans)
        self.beside = send.beside or (True,) * len(send.to)  # (unknown: held as if beside)
        self.final: set[str] = set()  # the parameters whose gradients are final
        self.finished: set[str] = set()  # and those whose layers are done

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
        return self.needs[k][c] <= (self.finished if self.beside[k] else self.final)

    def finish(self) -> list[int]:
        """The step's compute is done: the parts left go out; :meth:`result`."""
        self.send_rounds()
        return self.result()
