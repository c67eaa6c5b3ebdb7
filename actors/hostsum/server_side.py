"""A parameter server's side of a group summed by hosts (``topology.reduce: hosts``,
:mod:`.wire`): the blocks' sums of its slices taken in from its inbox part by part, and its
update applied a part at a time while the later parts still cross, whole or not at all."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from raysinga.optim.grads import sum_into

from ..common.buffers import Layout, SharedBuffer, UpdateGuard
from ..common.protocol import HostFrames
from ..common.slicing import Slice
from ..exchange.tcp import Inbox
from ..exchange.wire import Span, cut, decode, deltas
from ..memory.copies import ServerCopies
from ..memory.snapshots import Snapshots
from ..memory.values_out import ValueReaders


class ParamServer(Protocol):
    """What a server's update summed by hosts reads and changes of the server
    (:class:`~raysinga.actors.server.ParamServer`, which this module does not import: the
    role stands above what serves it)."""

    slices: list[Slice]  # its own slices
    layout: Layout  # of its slices, as they cross
    parts: list[list[Span]]  # its slices cut into the parts that cross one after another
    wire: str  # ``topology.wire``
    buf: SharedBuffer  # its values
    guard: UpdateGuard  # its version, odd while an update is under way
    optimizer: Any  # :class:`raysinga.optim.base.Optimizer`
    pool: ThreadPoolExecutor
    snaps: Snapshots
    copies: ServerCopies
    readers: ValueReaders
    inbox: Inbox | None
    host_sum: dict[str, np.ndarray] | None  # the blocks' sums of its slices, by slice name

    def check_abort(self) -> None: ...

    def publish(self) -> Any: ...


def take_part(server: ParamServer, step: int, frames: HostFrames, c: int) -> list[Span]:
    """Part ``c`` of the blocks' sums of ``server``'s slices (:func:`.wire.parts_of`), added
    in block order in float32 into its sum buffer; returns the part's ranges. Each leader sends
    its block's straight to the server's inbox; the wait looks for an abort meanwhile (a leader
    lost, or on a host gone silent)."""
    assert server.inbox is not None, "a server of a group summed by hosts has an inbox"
    taken = server.inbox.take(frames.epoch, step, frames.blocks, server.check_abort, part=c)
    got = [decode(f) for f in taken]
    part = server.parts[c]
    if server.host_sum is None:
        server.host_sum = server.layout.views(np.zeros(server.layout.nbytes, np.uint8))
    for j, dst in enumerate(cut(server.host_sum, part)):
        sum_into(dst, [g[j].reshape(-1) for g in got])
    return part


def blocks_sum(server: ParamServer, step: int, frames: HostFrames) -> dict[str, np.ndarray]:
    """The sum of the blocks' sums of ``server``'s slices, every part taken in
    (:func:`take_part`), by slice name."""
    for c in range(len(server.parts)):
        take_part(server, step, frames, c)
    assert server.host_sum is not None
    return server.host_sum


def update_by_parts(server: ParamServer, step: int, frames: HostFrames) -> Callable[[], Any]:
    """``server``'s update of ``step`` on a CPU: each part of its slices is summed, updated and
    its values pushed to the other nodes' mirrors as soon as every block's sum of it is in,
    while the later parts still cross. The step is applied whole or not at all: where a wait
    gives up (a leader lost, an abort), the parts updated so far are put back as they were,
    optimizer state and version with them. Every element is updated as one update of the whole
    sum updates it: the same bits. Returns what hands the values over once the step is noted
    (:meth:`~.server.ParamServer._updated`)."""
    server.snaps.wait_for_copy()  # a checkpoint's copy of the values must come first
    server.copies.wait_for_copy()  # and a copy kept for a rebuild
    guard, opt = server.guard, server.optimizer
    version, kept, skip = guard.version, [], set()
    values = {s.name: server.buf.arrays[s.name] for s in server.slices}
    diffs = deltas(server.wire) and bool(server.readers.based)  # readers to send differences
    try:
        for c in range(len(server.parts)):
            part = take_part(server, step, frames, c)
            if c == 0:
                # odd from here: an update under way. Until every block's first part is in,
                # no worker of the step is left to read the values, save one whose call went
                # out early (actors.hostsum.stub_side.block_steps), which waits for them even
                guard.__enter__()
            before = [a.copy() for a in cut(values, part)] if diffs else None
            with server.snaps.updating():  # a checkpoint's write in the background pauses
                assert server.host_sum is not None
                opt.update_spans(step, values, server.host_sum, part, server.pool, kept)
            server.readers.push_part(
                cut(values, part), version + 1, c, skip, server.check_abort, before
            )
    except BaseException:
        opt.restore_spans(kept)
        guard.set_version(version)
        raise
    opt.advance(list(values))
    guard.__exit__()
    if server.readers.pushes:
        return lambda: server.readers.pushed(guard.version)
    return server.publish
