"""The stub of one worker group: runs the group's steps against the servers.

One step: hand every worker the servers' current parameters, wait for all of them, sum their
gradients **in worker order** (each worker already divided by the group's batch size, so the sum
is the sub-batch-weighted average), clip, and send each server its slices. A group is
synchronous; groups are asynchronous to one another and meet only at the servers.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from raysinga.optim import PARALLEL_CHUNK, clip_grad_norm

from .buffers import Attachments, Layout, SharedBuffer, ShmHandle
from .errors import get_all, reports_role
from .server import node_id
from .slicing import Slice
from .worker import server_layouts


class Stub:
    role = "stub"

    def __init__(
        self,
        index: int,
        workers: list[Any],
        servers: list[Any],
        worker_infos: list[dict[str, Any]],
        server_infos: list[dict[str, Any]],
        shapes: dict[str, tuple[int, ...]],
        slices: list[Slice],
        dtype: str,
        clip_norm: float | None,
        n_groups: int,
        tag: str,
    ) -> None:
        self.index = self.group = index
        self.workers, self.servers = workers, servers
        self.clip_norm, self.n_groups = clip_norm, n_groups
        self.node = node_id()
        self.avg = SharedBuffer(f"{tag}-stub{index}", Layout.of(
            {p: (s, dtype) for p, s in shapes.items()}), self.node)
        self.count = self.avg.layout.nbytes // np.dtype(dtype).itemsize
        self.avg_flat = self.avg.flat.view(dtype)[: self.count]
        self.slices = slices
        # Summing is element-wise: contiguous ranges on several threads give the same bits.
        self.pool = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)))
        k = max(1, min(self.pool._max_workers, self.count // PARALLEL_CHUNK))
        self.ranges = [(self.count * i // k, self.count * (i + 1) // k) for i in range(k)]
        self.server_layouts = server_layouts(slices, len(servers), dtype)
        self._att = Attachments()
        self.worker_handles = [w["handle"] for w in worker_infos]
        self.snapshot = [w["node"] != self.node for w in worker_infos]
        self.server_remote = [s["node"] != self.node for s in server_infos]
        # For each worker and server: the server's shared buffer when they share a node, else
        # None, filled each step with the server's latest snapshot ref.
        self.local_src = [[s["handle"] if s["node"] == w["node"] else None for s in server_infos]
                          for w in worker_infos]
        self.refs = [s.get("ref") for s in server_infos]

    @reports_role
    def describe(self) -> dict[str, Any]:
        return {"node": self.node}

    def _sources(self, i: int) -> tuple[Any, ...]:
        return tuple(h if h is not None else self.refs[k] for k, h in enumerate(self.local_src[i]))

    def _grad_flat(self, i: int, snap: np.ndarray | None) -> np.ndarray:
        """Worker ``i``'s gradient buffer as one flat array, in place when on this node."""
        raw = snap if snap is not None else self._att.flat(self.worker_handles[i])
        return raw.view(self.avg_flat.dtype)[: self.count]

    @reports_role
    def run(self, start: int, stop: int) -> list[dict[str, float]]:
        """Run steps ``start .. stop-1`` of this group; per-step losses and timings."""
        records = []
        parts = len(self.workers)
        for step in range(start, stop):
            t0 = time.perf_counter()
            if self.n_groups > 1 and any(r is not None for r in self.refs):
                latest = get_all([s.latest.remote() for s in self.servers], "server")
                self.refs = [r for _, r in latest]
            futs = [w.compute.remote(step, i, parts, self.snapshot[i], *self._sources(i))
                    for i, w in enumerate(self.workers)]
            outs = get_all(futs, "worker", self.group)
            t1 = time.perf_counter()
            grads = [self._grad_flat(i, snap) for i, (_, snap) in enumerate(outs)]
            list(self.pool.map(lambda ab: self._sum(grads, *ab), self.ranges))
            norm = clip_grad_norm(self.avg.arrays, self.clip_norm) if self.clip_norm else None
            t2 = time.perf_counter()
            ups = [s.update.remote(step, self._update_arg(k)) for k, s in enumerate(self.servers)]
            results = get_all(ups, "server")
            self.refs = [ref for _, ref in results]
            t3 = time.perf_counter()
            fetch = max(st["fetch"] for st, _ in outs)
            compute = max(st["compute"] for st, _ in outs)
            rec = {"step": step, "loss": sum(st["loss"] for st, _ in outs),
                   "fetch": fetch, "compute": compute, "gather": t1 - t0 - fetch - compute,
                   "average": t2 - t1, "update": t3 - t2, "total": t3 - t0}
            if norm is not None:
                rec["grad_norm"] = norm
            records.append(rec)
        return records

    def _sum(self, grads: list[np.ndarray], a: int, b: int) -> None:
        """``avg[a:b] = g0 + g1 + ...``, added in worker order whatever the arrival order."""
        out = self.avg_flat[a:b]
        if len(grads) == 1:
            np.copyto(out, grads[0][a:b])
            return
        np.add(grads[0][a:b], grads[1][a:b], out=out)
        for g in grads[2:]:
            np.add(out, g[a:b], out=out)

    def _update_arg(self, k: int) -> ShmHandle | np.ndarray:
        if not self.server_remote[k]:
            return self.avg.handle()
        lay = self.server_layouts[k]
        out = np.zeros(lay.nbytes, np.uint8)
        views = lay.views(out)
        for s in self.slices:
            if s.server == k:
                views[s.name][...] = self.avg.arrays[s.param].reshape(-1)[s.start : s.stop]
        return out

    @reports_role
    def evaluate(self, batch_size: int) -> dict[str, float]:
        """Test metrics of the current parameters, computed by this group's first worker."""
        if self.n_groups > 1 and any(r is not None for r in self.refs):
            self.refs = [r for _, r in get_all([s.latest.remote() for s in self.servers],
                                               "server")]
        src = self._sources(0)
        return get_all([self.workers[0].evaluate.remote(batch_size, *src)], "worker", 0)[0]

    @reports_role
    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False)
        self._att.close()
        self.avg.close()
