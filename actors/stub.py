"""The stub of one worker group: runs the group's steps against the servers.

One step: hand every worker the servers' current parameters, wait for all of them, sum their
gradients **in worker order** (each worker already divided by the group's batch size, so the sum
is the sub-batch-weighted average), clip, and send each server its slices. A group is
synchronous; groups are asynchronous to one another and meet only at the servers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from raysinga.kernels.cpu_memory import retain_freed_memory
from raysinga.obs.raymetrics import Recorder
from raysinga.optim.grads import chunks, clip_grad_norm, on_threads, sum_into

from .common.buffers import Attachments, Layout, SharedBuffer, ShmHandle
from .common.errors import ActorLost, cancelled_on_failure, get_all, lost_server, reports_role
from .common.protocol import (
    MirrorAt,
    Published,
    Pushed,
    StepStats,
    StubSpec,
    SummedGrads,
    node_id,
    read_state_copy,
    server_layouts,
    server_slices,
    worker_buffer_layout,
)
from .exchange.bells import GroupBells, step_record
from .exchange.fence import Fence
from .exchange.mirrors import first_on_each_node
from .exchange.traffic import HostNames, group_step_bytes
from .exchange.wire import blocks
from .hostsum.stub_side import block_steps
from .memory.replay import ReplayLog


class Stub(Fence):
    """Runs its group's steps. Where the whole synchronous group shares this node, the
    per-step control goes through the group's doorbells (:class:`GroupBells`), else through
    Ray calls; where the servers can sum the gradients themselves, the roles ring one another
    and the stub only starts and watches each chunk."""

    role = "stub"

    def __init__(
        self,
        spec: StubSpec,
        workers: list[Any],
        servers: list[Any],
        worker_infos: list[dict[str, Any]],
        server_infos: list[dict[str, Any]],
    ) -> None:
        """``workers``: this group's worker handles, ``servers``: all servers' handles, and
        beside each list the roles' ``describe()`` answers (a server's with its snapshot
        ``ref``, where it publishes one)."""
        retain_freed_memory()
        self.index = self.group = spec.index
        self.rec = Recorder(spec.metrics, "stub", spec.index, spec.index)
        self._address = HostNames()  # (the metrics' host tags)
        self.label = f"{spec.tag} group {spec.index}"  # the run (name and id), the role
        self.servers = servers  # the workers are wired by _wire_workers, as on a rewire
        self.clip_norm, self.n_groups = spec.clip_norm, spec.n_groups
        self.node = node_id()
        dtype = spec.dtype
        self.avg = SharedBuffer(
            f"{spec.tag}-stub{spec.index}",
            Layout.of({p: (s, dtype) for p, s in spec.shapes.items()}),
            self.node,
        )
        self.count = self.avg.layout.nbytes // np.dtype(dtype).itemsize
        self.avg_flat = self.avg.flat.view(dtype)[: self.count]
        self.slices = spec.slices
        self.block, self.wire = spec.block, spec.wire  # topology.reduce: hosts (0: not)
        # Summing is element-wise: contiguous ranges on several threads give the same bits.
        self.pool = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)))
        self.ranges = chunks(self.count, self.pool)
        self.server_layouts = server_layouts(spec.slices, len(servers), dtype)
        self._att = Attachments()
        self.refs = [s.get("ref") for s in server_infos]
        self.server_infos = server_infos
        self.server_remote = [s["node"] != self.node for s in server_infos]
        self.heard = 0.0  # when the last step was heard back (reduce: hosts)
        self.bells: GroupBells | None = None
        self.chunks = 0  # chunks served through doorbells: numbers each chunk's go messages
        # each step's summed gradient, and the servers' copies: what a lost server is rebuilt from
        self.shapes, self.dtype = spec.shapes, dtype
        self._snaps: dict[int, np.ndarray] = {}  # the latest snapshot of each remote worker
        self.log = ReplayLog(
            self.count,
            dtype,
            spec.replay,
            f"{spec.tag}-log-stub{spec.index}",
            self.node,
            len(servers),
        )
        self._wire_workers(workers, worker_infos)

    def __repr__(self) -> str:  # how Ray's dashboard and log prefixes name this actor
        return f"Stub({self.label})"

    def _wire_workers(self, workers: list[Any], worker_infos: list[dict[str, Any]]) -> None:
        """Connect this group's workers: their gradient buffers, where each reads the servers
        from, and (one synchronous group entirely on this node) the doorbells."""
        self.workers = workers
        self.worker_handles = [w["handle"] for w in worker_infos]
        self.worker_state = [w.get("state", {}) for w in worker_infos]
        for i, w in enumerate(worker_infos):  # mapped now: the map outlives a lost worker's file
            if self.worker_state[i] and w["node"] == self.node:
                self._att.flat(self.worker_handles[i])
        self.worker_nodes = [w["node"] for w in worker_infos]
        self.snapshot = [w["node"] != self.node for w in worker_infos]
        if self.block:  # summed by blocks: a worker's gradient goes to its block's leader
            self.blocks = blocks(len(worker_infos), self.block)
            lead = {i: b[0] for b in self.blocks for i in b}
            self.snapshot = [
                self.worker_nodes[i] != self.worker_nodes[lead[i]] for i in range(len(lead))
            ]
        # Summed by hosts: each worker's node's mirrors of the servers, its first worker's
        firsts = first_on_each_node(worker_infos)
        self.mirror_src = [
            (firsts[w["node"]].get("mirror") or {}).get("handles") for w in worker_infos
        ]
        # For each worker and server: the server's shared buffer when they share a node, else
        # None, filled each step with the server's latest snapshot ref.
        self.local_src = [
            [s["handle"] if s["node"] == w["node"] else None for s in self.server_infos]
            for w in worker_infos
        ]
        if self.bells is not None:
            self.bells.close()
            self.bells = None
        same_node = all(w["node"] == self.node for w in worker_infos) and not any(
            self.server_remote
        )
        if self.n_groups == 1 and same_node and not self.block:
            handles = [s["handle"] for s in self.server_infos]
            self.bells = GroupBells(self.avg.path, self.group, workers, self.servers, handles)
        # The servers sum the workers' gradients in their update, into the log's row (CPU
        # servers, nothing to clip, the log in shared memory): the stub's pass is saved.
        self.summing = self.bells is not None and not self.clip_norm and self.log.shared
        self.summing &= not any(s.get("gpu") for s in self.server_infos)

    @reports_role
    def rewire(
        self,
        workers: list[Any],
        worker_infos: list[dict[str, Any]],
        servers: list[Any],
        server_infos: list[dict[str, Any]],
    ) -> None:
        """A lost worker or server was replaced: connect the group's workers and the servers
        as they are now (with the servers' snapshot refs, which a worker elsewhere reads)."""
        self._att.close()
        self._att = Attachments()
        self.servers, self.server_infos = servers, server_infos
        self.refs = [s.get("ref") for s in server_infos]
        self.server_remote = [s["node"] != self.node for s in server_infos]
        self._wire_workers(workers, worker_infos)

    @reports_role
    def keep_copies(self, which: list[int]) -> None:
        """Have servers ``which`` take a copy of themselves now and every half of the log: map
        the copies of those on this node (:meth:`ReplayLog.attach`), fetch the others' through
        Ray (:meth:`ReplayLog.collect`)."""
        every = self.log.copy_every
        calls = [
            self.servers[k].keep_copies.remote(every, not self.server_remote[k]) for k in which
        ]
        handles = get_all(calls, "server", None, None, which)
        self.log.attach({k: h for k, h in zip(which, handles, strict=True) if h is not None})
        self.log.collect(
            {k: self.servers[k] for k, h in zip(which, handles, strict=True) if h is None}
        )

    @reports_role
    def rebuild(self, k: int, server: Any, target: int | None) -> int | None:
        """Bring ``server``, new in lost server ``k``'s place, to version ``target`` from the
        lost one's copy and this stub's log (:meth:`ReplayLog.rebuild`)."""
        lay = self.server_layouts[k]
        return self.log.rebuild(k, server, target, self.avg.layout, self.slices, lay)

    @reports_role
    def async_plan(self, k: int) -> list[tuple[int, int, int]] | None:
        """For a lost server ``k`` of asynchronous groups (this stub keeps the copies): the
        updates it noted since its newest copy, ``(version, group, step)`` in order, each to be
        replayed from its group's stub's log; None where there is nothing exact to rebuild it
        from (:meth:`ReplayLog.async_plan`)."""
        plan = self.log.async_plan(k)
        return None if plan is None else plan[1]

    @reports_role
    def restore_copy(self, k: int, server: Any) -> int | None:
        """Load lost server ``k``'s newest copy into ``server``, new in its place; returns the
        copy's version (None: no copy)."""
        plan = self.log.async_plan(k)
        if plan is None:
            return None
        return get_all([server.load_copy.remote(plan[0])], "server", indices=[k])[0]

    @reports_role
    def logged(self, step: int, k: int) -> np.ndarray | None:
        """Server ``k``'s slices of this group's step ``step`` as this stub logged it (laid out
        as the server's ``update`` takes them); None where the log no longer holds it."""
        row = self.log.row_of(step)
        if row is None:
            return None
        return self.log.server_grads(row, self.avg.layout, self.slices, k, self.server_layouts[k])

    @reports_role
    def worker_state(self, i: int, at: int) -> dict[str, np.ndarray] | None:
        """Worker ``i``'s copy of its state at the start of step ``at`` (batch norm's running
        statistics), from its buffer (mapped here, and alive after its process) or, for a
        worker on another node, its latest snapshot; None where there is none. Asked for
        before the group is rewired, so ``i`` still names the lost worker."""
        names = list(self.worker_state[i])
        if not names:
            return {}
        if self.snapshot[i]:
            raw = self._snaps.get(i)
            if raw is None:
                return None
        else:
            raw = self._att.flat(self.worker_handles[i])
        layout = worker_buffer_layout(self.shapes, self.dtype, self.worker_state[i])
        return read_state_copy(layout.views(raw), names, at)

    @reports_role
    def replay_sizes(self) -> dict[str, int]:
        return self.log.sizes()

    @reports_role
    def describe(self) -> dict[str, Any]:
        return {"node": self.node, "pid": os.getpid()}

    def sources(self, i: int) -> tuple[Any, ...]:
        return tuple(
            h if h is not None else self._remote_source(k, i)
            for k, h in enumerate(self.local_src[i])
        )

    def _remote_source(self, k: int, i: int) -> Any:
        """Server ``k``'s values for worker ``i`` on another node: its mirror on the worker's
        node where the server pushes them there (:mod:`.mirrors`), else published."""
        ref = self.refs[k]
        if isinstance(ref, Pushed):
            return MirrorAt(self.mirror_src[i][k], ref.version, k, ref.generation)
        return Published(self._ref_for(k, i))

    def _ref_for(self, k: int, i: int) -> Any:
        """Server ``k``'s published values for worker ``i``: the copy for its node where the
        server publishes one per node (any copy for a node it does not know yet)."""
        ref = self.refs[k]
        if not isinstance(ref, dict):
            return ref
        return ref.get(self.worker_nodes[i], next(iter(ref.values())))

    def _grad_flat(self, i: int, snap: np.ndarray | None) -> np.ndarray:
        """Worker ``i``'s gradient buffer as one flat array, in place when on this node."""
        raw = snap if snap is not None else self._att.flat(self.worker_handles[i])
        return raw.view(self.avg_flat.dtype)[: self.count]

    @reports_role
    def run(self, start: int, stop: int) -> list[StepStats]:
        """Run steps ``start .. stop-1`` of this group: each step's loss and timings (also
        recorded as Ray metrics, where the run records them)."""
        records = self._run(start, stop)
        self.rec.steps(records, self._address)
        return records

    def _run(self, start: int, stop: int) -> list[StepStats]:
        bells = self.bells
        serving = []
        if bells is not None:
            self.chunks += 1
            if self.summing:
                self.log.drop_unfinished()  # none writes now: a failed chunk's mark is stale
            serving = bells.start_serving(
                self.chunks, start, stop, self.summing, self._server_grads(), self.epoch
            )
            if self.summing:
                return bells.run_alone(start, serving, self._seal)
        if self.block:
            return block_steps(self, start, stop)
        records = []
        for step in range(start, stop):
            t0 = time.time()  # (wall clock: the workers' own times are compared with it)
            if bells is not None:
                outs = [(st, None) for st in bells.ring_workers(step, serving)]
            else:
                outs = self._call_workers(step)
                published = self.published_bytes()  # the values these workers read
            t1 = time.time()
            grads = [self._grad_flat(i, snap) for i, (_, snap) in enumerate(outs)]
            self._snaps.update({i: snap for i, (_, snap) in enumerate(outs) if snap is not None})
            on_threads(self.pool, functools.partial(self._sum, self.avg_flat, grads), self.ranges)
            norm = clip_grad_norm(self.avg.arrays, self.clip_norm) if self.clip_norm else None
            t2 = time.time()
            # logged while the servers read the same sum (before the next step overwrites it)
            logged = self.pool.submit(self.log.record, step, self.avg_flat)
            traffic = None  # a group on one node moves nothing between nodes
            try:
                if bells is not None:
                    seconds = bells.ring_servers(step, serving)
                else:
                    seconds, sent = self._call_servers(step)
                    snaps = [0 if snap is None else snap.nbytes for _, snap in outs]
                    nodes = [s["node"] for s in self.server_infos]
                    traffic = group_step_bytes(
                        self.node, self.worker_nodes, snaps, nodes, sent, published
                    )
            finally:
                logged.result()
            stats = [st for st, _ in outs]
            t3 = time.time()
            records.append(step_record(step, stats, t0, t1, t2, t3, seconds, norm, traffic))
        if bells is not None:
            bells.finish(serving)
        return records

    def _seal(self) -> None:
        """Sum again the log row of a step a server began and did not finish (the workers
        wait for every server before the next step, so their buffers still hold it): the lost
        server is rebuilt through that step. If this fails, the row stays unlogged (a restart
        then)."""
        step = self.log.unfinished()
        if step is None:
            return
        with contextlib.suppress(Exception):
            grads = [self._grad_flat(i, None) for i in range(len(self.workers))]
            row = self.log.begin(step)
            on_threads(self.pool, functools.partial(self._sum, row, grads), self.ranges)
            self.log.commit(step)

    # -- per-step control through Ray calls (any placement)
    def _call_workers(self, step: int) -> list[tuple[dict, np.ndarray | None]]:
        if self.n_groups > 1 and any(r is not None for r in self.refs):
            latest = get_all([s.latest.remote() for s in self.servers], "server")
            self.refs = [r for _, r in latest]
        parts = len(self.workers)
        futs = [
            w.compute.remote(step, i, parts, self.snapshot[i], *self.sources(i), epoch=self.epoch)
            for i, w in enumerate(self.workers)
        ]
        with self.server_snapshots(), cancelled_on_failure(futs):
            return get_all(futs, "worker", self.group)

    def _call_servers(self, step: int) -> tuple[list[float], list[int]]:
        """Each server's update of ``step``: the seconds each took, and the bytes of the
        slices sent to each on another node (0 for one on this node)."""
        args = [self._update_arg(k) for k in range(len(self.servers))]
        ups = [
            s.update.remote(step, arg, self.group, self.epoch)
            for s, arg in zip(self.servers, args, strict=True)
        ]
        with cancelled_on_failure(ups):
            results = get_all(ups, "server")
        self.refs = [ref for _, ref, _ in results]
        sent = [a.nbytes if isinstance(a, np.ndarray) else 0 for a in args]
        return [t for _, _, t in results], sent

    def published_bytes(self) -> list[int]:
        """The size of each server's published values that a worker elsewhere reads this
        step (0 for a server that publishes none)."""

        def size(ref: Any, info: dict[str, Any]) -> int:
            if ref is None:
                return 0
            if isinstance(ref, Pushed) and ref.nbytes:  # as pushed (compressed, maybe)
                return ref.nbytes
            return int(info.get("published_bytes", 0))

        return [size(ref, info) for ref, info in zip(self.refs, self.server_infos, strict=True)]

    @staticmethod
    def _sum(out: np.ndarray, grads: list[np.ndarray], ab: tuple[int, int]) -> None:
        """``out[a:b] = g0 + g1 + ...``, added in worker order whatever the arrival order."""
        a, b = ab
        sum_into(out[a:b], [g[a:b] for g in grads])

    def _server_grads(self) -> ShmHandle | SummedGrads:
        """What the servers' ``serve`` calls read each step's gradient from."""
        if not self.summing:
            return self.avg.handle()
        return SummedGrads(tuple(self.worker_handles), self.log.handle(), self.log.n_rows)

    def _update_arg(self, k: int) -> ShmHandle | np.ndarray:
        if not self.server_remote[k]:
            return self.avg.handle()
        return server_slices(self.avg.arrays, self.slices, k, self.server_layouts[k])

    @reports_role
    def evaluate(self, batch_size: int) -> dict[str, float]:
        """Test metrics of the current parameters, computed by this group's first worker."""
        if self.n_groups > 1 and any(r is not None for r in self.refs):
            self.refs = [r for _, r in get_all([s.latest.remote() for s in self.servers], "server")]
        src = self.sources(0)
        with self.server_snapshots():
            return get_all([self.workers[0].evaluate.remote(batch_size, *src)], "worker", 0)[0]

    @contextlib.contextmanager
    def server_snapshots(self) -> Iterator[None]:
        """A worker on another node reads a server's published snapshot, which the server
        owns: a lost snapshot means a lost server, named as such (the driver rebuilds it)."""
        try:
            yield
        except Exception as e:
            k = lost_server(e, self.servers)
            if k is None:
                raise
            raise ActorLost("server", k, None, "its published values went with it") from e

    @reports_role
    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.log.close()
        if self.bells is not None:
            self.bells.close()
        self.pool.shutdown(wait=False)
        self._att.close()
        self.avg.close()
