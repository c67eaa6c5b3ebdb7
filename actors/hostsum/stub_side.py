"""A synchronous group summed by hosts (``topology.reduce: hosts``, :mod:`.wire`): the
stub's side of its steps (a block's sum on its way to the servers is :mod:`.worker_side`).

Each worker computes its gradient into its shared-memory buffer. Each block's leader, once its
members are done, sums their buffers in worker order and sends each server its slices of the
sum over a TCP connection of its own (:mod:`.tcp`). Each server takes its slices of every block
in and sums them in block order (:meth:`~.server.ParamServer._update`). The stub only sends
the calls: no gradient passes through it.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ..common.errors import cancel, cancelled_on_failure, get_all
from ..common.protocol import (
    BlockSend,
    HostFrames,
    MirrorAt,
    Published,
    Pushed,
    ServerAt,
    StepStats,
    worker_buffer_layout,
)
from ..exchange.bells import step_record
from ..exchange.traffic import block_step_bytes


class Stub(Protocol):
    """What a group's steps summed by hosts read of its stub (:class:`~raysinga.actors.stub.
    Stub`, which this module does not import: the role stands above what serves it)."""

    group: int
    epoch: int
    dtype: Any
    shapes: dict[str, tuple[int, ...]]
    blocks: list[list[int]]  # each block's workers, its leader first
    servers: list[Any]  # the servers' actor handles
    server_infos: list[dict[str, Any]]
    refs: list[Any]  # what each server last handed over of its values
    workers: list[Any]  # the workers' actor handles
    worker_handles: list[Any]  # their gradient buffers
    worker_nodes: list[str]
    worker_state: list[dict[str, Any]]
    snapshot: list[bool]  # whether each worker's gradient crosses as a snapshot
    local_src: list[list[Any]]
    mirror_src: list[list[Any]]
    heard: float  # when the last step was heard back

    def sources(self, i: int) -> tuple[Any, ...]: ...

    def published_bytes(self) -> list[int]: ...

    def server_snapshots(self) -> AbstractContextManager[None]: ...


def block_steps(stub: Stub, start: int, stop: int) -> list[StepStats]:
    """Steps ``start .. stop-1`` summed by blocks (``topology.reduce: hosts``, :mod:`.wire`):
    each worker computes; each block's leader, once its members are done, sums them and cuts
    the sum into the servers' slices and sends each its own (:mod:`.tcp`); each server takes
    its slices of every block in and sums them in block order. A block of one worker sends
    its gradient as it computes it, the last layers' first
    (:class:`~.worker_side.EarlySends`), and needs no sum. A step's computes, sums and updates
    go out at once (a leader sums once its members are done, a server updates each part once
    every block's sum of it is in); this stub never touches a gradient.

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
    with stub.server_snapshots(), cancelled_on_failure(computes + ups):
        by_worker = get_all(computes, "worker", stub.group)
        by_server = get_all(ups, "server")
    nodes = [s["node"] for s in stub.server_infos]
    records = []
    for j, step in enumerate(range(start, stop)):
        stats = [w[j] for w in by_worker]
        done = [s[j] for s in by_server]
        _one_update_on(step, [v + j for v in at], [v for v, _, _, _ in done])
        published = stub.published_bytes()  # the values this step's workers read
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
    (:class:`~.worker_side.EarlySends`), by worker."""
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
    """Worker ``i``'s sources of the servers' values: as :meth:`~.stub.Stub.sources`, or
    (``at``) those after ``at[k]`` updates of server ``k``, waited for where it reads them."""
    if at is None:
        return stub.sources(i)
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
    if sent.at is not None:
        _one_update_on(sent.step, sent.at, [v for v, _, _ in sent.results])
    return record


def _one_update_on(step: int, read: list[int], after: list[int]) -> None:
    """``step`` read the servers' values after ``read`` updates; they must stand one update
    further each (``after``), else a step sent ahead waits for values that never come or
    reads the wrong ones: the step fails instead."""
    if after != [v + 1 for v in read]:
        raise RuntimeError(
            f"step {step} read the servers' values after {read} updates and left them after "
            f"{after}: a step sent ahead would read the wrong ones"
        )


def _collect(stub: Stub, sent: _Step) -> StepStats:
    """Wait for ``sent``'s calls: the step's record. Where one fails, the others are
    cancelled (:func:`.errors.cancelled_on_failure`) and the failure raised."""
    published = stub.published_bytes()  # the values its workers read: the last step's
    summed = [b for b, m in enumerate(stub.blocks) if len(m) > 1]
    with stub.server_snapshots(), cancelled_on_failure(sent.calls()):
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
