"""The running state of the distributed controller: chunks of steps handed to the groups' stubs.

The driver never runs a step itself. It hands each group a chunk (steps ``s .. e-1``) and waits
for any chunk to end; between chunks it reports progress, evaluates, and asks the controller
whether to hold: a hold (a checkpoint due by time, a stop signal, room to grow) lets the chunks
under way end without launching more, until every group stands at a step boundary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from raysinga.actors.common.errors import get_all
from raysinga.actors.common.protocol import TIMINGS, StepStats
from raysinga.actors.exchange.traffic import host_names, per_host
from raysinga.obs.events import Evaluated, EventHub, TrainStep
from raysinga.run.divergence import Guard, describe_topology

from .silence import Silent, Watch


class StepRunner:
    """The groups' progress through one launch of the roles: which steps each group has done,
    the chunks under way, and the window of step statistics the next report averages."""

    def __init__(
        self, cfg: Any, topo: Any, plan: Any, hub: EventHub, steps0: list[int], history: list
    ) -> None:
        self.cfg, self.topo, self.plan, self.hub = cfg, topo, plan, hub
        lr_scale, async_none = cfg.lr_scale(topo), cfg.updater.get("async_lr") == "none"
        self.guard = Guard(
            cfg.divergence,
            history,
            steps0,
            plan.chance_loss,
            lambda s: (plan.schedule(s) * lr_scale, describe_topology(topo)),
            cfg.data.batch_size,
            async_rule=async_none and topo.n_groups > 1,
        )
        self.done = list(steps0)
        self.chunks: dict[Any, tuple[int, int, int]] = {}  # ref -> (group, start, end)
        self.interrupted: tuple[int, int, int] | None = None  # a chunk that ended with a loss
        self.window: list[StepStats] = []
        self.t_window = time.perf_counter()
        self.barrier = cfg.next_checkpoint(max(self.done))  # the next periodic checkpoint
        self.max_chunk = 1 << 30
        self.watch: Watch | None = None  # the heartbeat to the roles while chunks run
        self.abandoned: list[Any] = []  # chunks given up on a silent role: fetched at the end
        self.hosts: dict[str, str] = {}  # node id -> the name its host is shown by

    @property
    def progress(self) -> int:
        """The most steps a group has done (as far as the driver knows)."""
        return max(self.done)

    @property
    def finished(self) -> bool:
        return all(d >= self.cfg.train_steps for d in self.done)

    def passed_boundary(self) -> None:
        """A checkpoint boundary is behind: run on to the next one."""
        self.barrier = self.cfg.next_checkpoint(self.progress)

    def run(self, roles: Any, hold: Callable[[], bool]) -> None:
        """Run chunks until every group is held or finished: a step boundary for all.
        ``hold()`` is asked between chunks (a synchronous group's servers are busy serving
        during one); once it says yes, no more chunks are launched."""
        held = False
        while True:
            for g in range(self.topo.n_groups):
                if not held and all(c[0] != g for c in self.chunks.values()):
                    self._launch(roles, g)
            if not self.chunks:
                return
            ready = self._wait()
            self.interrupted = self.chunks.pop(ready[0])
            g, _, e = self.interrupted
            stats: list[StepStats] = get_all(ready, "stub", g)[0]
            self.interrupted = None
            self._check(stats, g)  # before a checkpoint can take what follows
            self.window += stats
            self.done[g] = e
            self._tune_chunks()
            if g == 0:
                self._report(roles, e)
            held = held or hold()

    def _wait(self) -> list[Any]:
        """The first chunk to end, while the watch (where there is one) listens to the roles:
        a silent role ends the wait with :class:`Silent`, its group's chunk abandoned (it
        waits on that role) and counted as interrupted."""
        while True:
            poll = self.watch.poll_s if self.watch is not None else None
            ready, _ = ray.wait(list(self.chunks), num_returns=1, timeout=poll)
            if ready:
                return ready
            assert self.watch is not None
            try:
                for line in self.watch.check():
                    self.hub.notice(line)
            except Silent as e:
                g = e.group if e.group is not None else 0
                for ref, chunk in list(self.chunks.items()):
                    if chunk[0] == g or self.topo.n_groups == 1:
                        self.interrupted = self.chunks.pop(ref)
                        self.abandoned.append(ref)
                raise

    def drain(self, timeout_s: float) -> bool:
        """Let the chunks still under way end (other groups', after one group's chunk failed):
        what a finished one did counts, a failed one's steps are done again. False where one
        has not ended within ``timeout_s``."""
        refs = list(self.chunks)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        for ref in ready:
            g, _, e = self.chunks.pop(ref)
            try:
                stats: list[StepStats] = ray.get(ref)
            except Exception:  # noqa: BLE001 - the loss being recovered from, seen by this group
                continue
            self._check(stats, g)
            self.window += stats
            self.done[g] = e
        return not self.chunks

    def _launch(self, roles: Any, g: int) -> None:
        s, total = self.done[g], self.cfg.train_steps
        if s >= total or (self.barrier is not None and s >= self.barrier):
            return
        e = self._chunk_end(s)
        G, staleness = self.topo.n_groups, self.topo.staleness
        if staleness is not None and G > 1 and e - 1 - min(self.done) > staleness:
            return  # too far ahead of the slowest group: wait for it
        self.chunks[roles.stubs[g].run.remote(s, e)] = (g, s, e)

    def _chunk_end(self, s: int) -> int:
        """Where a chunk from step ``s`` ends: at the first boundary ahead (the run's end, a
        report, an evaluation, a checkpoint, the staleness bound of asynchronous groups), or
        after :attr:`max_chunk` steps where that boundary is further than half as many again.
        A boundary a little past :attr:`max_chunk` is taken whole rather than reached in a
        full chunk and a sliver: each chunk costs its group a round trip through this driver
        and one step taken alone (:func:`raysinga.actors.hostsum.stub_side.block_steps`)."""
        cfg = self.cfg
        ends = [cfg.train_steps, (s // cfg.disp_freq + 1) * cfg.disp_freq]
        if cfg.test_freq:
            ends.append((s // cfg.test_freq + 1) * cfg.test_freq)
        nxt = cfg.next_checkpoint(s)
        if nxt is not None:
            ends.append(nxt)
        if self.topo.staleness is not None and self.topo.n_groups > 1:
            ends.append(s + max(1, self.topo.staleness))
        bound, most = min(ends), self.max_chunk
        return bound if bound - s <= most + most // 2 else s + most

    def _tune_chunks(self) -> None:
        """Keep chunks (steps run between two visits of this loop) near a second, and under
        one and a half (:meth:`_chunk_end`), so that a stop signal or a time-based checkpoint
        is acted on soon."""
        if self.window:
            per_step = max(sum(r.total for r in self.window) / len(self.window), 1e-4)
            self.max_chunk = max(1, int(1.0 / per_step))
            if self.watch is not None:
                self.watch.step_s = per_step

    def _check(self, stats: list[StepStats], g: int) -> None:
        """The divergence guard sees each step's loss (and gradient norm, where clipping
        computes it); a divergence stops the run."""
        for r in stats:
            level = self.guard.observe(r.step, r.loss, r.grad_norm, g)
            if level is not None:
                self.hub.emit(level)

    def _report(self, roles: Any, e: int) -> None:
        """Group 0 reached step ``e``: report training, and evaluate where due."""
        cfg, total = self.cfg, self.cfg.train_steps
        if e % cfg.disp_freq == 0 or e == total:
            self.hub.emit(self._train_event(e, time.perf_counter() - self.t_window))
            self.window, self.t_window = [], time.perf_counter()
        if cfg.evaluation_due(e):
            metrics = get_all([roles.stubs[0].evaluate.remote(cfg.data.eval_batch_size)], "stub", 0)
            if metrics[0]:
                self.hub.emit(Evaluated(e, total, metrics[0]))
            self.t_window = time.perf_counter()  # evaluation time is not training throughput

    def _train_event(self, step: int, dt: float) -> TrainStep:
        window, cfg = self.window, self.cfg
        n = max(len(window), 1)
        mean = {k: sum(getattr(r, k) for r in window) / n for k in (*TIMINGS, "total")}
        plan_steps = max(self.plan.n_train // cfg.data.batch_size, 1)
        return TrainStep(
            step,
            cfg.train_steps,
            ((step - 1) * self.topo.n_groups) // plan_steps,
            sum(r.loss for r in window) / n,
            self.plan.schedule(step - 1) * self.cfg.lr_scale(self.topo),
            len(window) * cfg.data.batch_size / max(dt, 1e-9),
            # the window's last step, as in the single-process trainer
            window[-1].grad_norm if window else None,
            {k: round(v * 1e3, 3) for k, v in mean.items()},
            self._net(window) or None,
        )

    def _net(self, window: list[StepStats]) -> dict[str, dict[str, int]]:
        """Bytes in and out of each host per step of a group, the window's mean."""
        routes = [r.traffic for r in window]
        nodes = {node for t in routes for a, b, _ in t for node in (a, b)}
        if nodes - set(self.hosts):  # a node not named yet (a role replaced elsewhere)
            self.hosts = host_names(ray.nodes())
        return per_host(routes, self.hosts, len(window))
