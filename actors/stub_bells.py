"""A stub's per-step control through doorbells, for one synchronous group whose roles share
the stub's node: each worker and server runs a ``serve`` call for a whole chunk of steps. The
stub rings each step's go and waits for their done messages in shared memory; or, where the
servers sum the gradients, the roles ring one another and the stub waits for their calls."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any

from raysinga.optim.grads import on_threads

from .doorbell import wait_all
from .errors import get_all
from .protocol import Go, StepStats, Wiring, WorkerDone

ENDED_GRACE_S = 5.0  # how long a doorbell may stay silent after a serve call ended normally


class GroupBells:
    """The doorbell half of :class:`actors.stub.Stub` (its ``bells``, ``workers``,
    ``servers``, ``server_infos``, ``group`` and ``_server_grads``)."""

    bells: dict[str, Any]
    workers: list[Any]
    servers: list[Any]
    server_infos: list[dict[str, Any]]
    group: int
    summing: bool
    log: Any
    pool: Any
    ranges: list[tuple[int, int]]
    _ended_since: float | None
    _chunk: int

    def _grad_flat(self, i: int, snap: Any) -> Any:
        raise NotImplementedError

    def _sum(self, out: Any, grads: list[Any], ab: tuple[int, int]) -> None:
        raise NotImplementedError

    def _server_grads(self) -> Any:
        raise NotImplementedError

    def _close_bells(self) -> None:
        for bell in [
            *self.bells.get("go_w", []),
            *self.bells.get("go_s", []),
            self.bells.get("done_w"),
            self.bells.get("done_s"),
        ]:
            if bell is not None:
                bell.close()
                if os.path.exists(bell.path):
                    os.unlink(bell.path)
        self.bells = {}

    def _start_serving(self, start: int, stop: int) -> list[Any]:
        """Start every worker's and server's ``serve`` call for steps ``start .. stop-1``.
        Where the servers sum the gradients (``summing``) the roles ring one another, and the
        stub starts the chunk (:meth:`_run_alone`); else it rings every hand-over itself."""
        self._chunk += 1  # tells this chunk's go messages from any a failed one left
        go_w = [b.path for b in self.bells["go_w"]]
        go_s = [b.path for b in self.bells["go_s"]]
        done_w, done_s = self.bells["done_w"].path, self.bells["done_s"].path
        n_w, n_s = len(self.workers), len(self.servers)
        if self.summing:  # no done messages: each serve call returns what it measured
            to_w = [Wiring(self._chunk, p, "", n_s, tuple(go_s)) for p in go_w]
            to_s = [Wiring(self._chunk, p, "", n_w, tuple(go_w), 1) for p in go_s]
        else:
            to_w = [Wiring(self._chunk, p, done_w) for p in go_w]
            to_s = [Wiring(self._chunk, p, done_s) for p in go_s]
        handles = [s["handle"] for s in self.server_infos]
        refs = [
            w.serve.remote(start, stop, i, n_w, to_w[i], *handles)
            for i, w in enumerate(self.workers)
        ]
        grads = self._server_grads()
        refs += [s.serve.remote(start, stop, to_s[k], grads) for k, s in enumerate(self.servers)]
        return refs

    def _ring(self, bells: list[Any], step: int, times: int = 1) -> None:
        go = Go(step, self._chunk)
        for bell in bells:
            for _ in range(times):
                bell.ring(go)

    def _run_alone(self, start: int, stop: int) -> list[StepStats]:
        """Steps ``start .. stop-1`` of roles that ring one another (``summing``): the stub
        starts them, waits for their calls to end, and builds each step's timings from what
        they measured. Where a call fails, a log row a lost server left half-written is summed
        here first (:meth:`_seal`)."""
        import ray  # noqa: PLC0415

        self.log.drop_unfinished()  # none writes now: a mark left by a failed chunk is stale
        serving = self._start_serving(start, stop)
        t0 = time.time()
        self._ring(self.bells["go_w"], start, times=len(self.servers))  # each server's, as it were
        ended: dict[Any, Any] = {}  # a call that returned -> what it returned
        try:
            while not_done := [r for r in serving if r not in ended]:
                ready, _ = ray.wait(not_done, num_returns=1)
                i, k = serving.index(ready[0]), len(self.workers)
                if i < k:
                    ended[ready[0]] = get_all(ready, "worker", self.group, indices=[i])[0]
                else:
                    ended[ready[0]] = get_all(ready, "server", indices=[i - k])[0]
        except BaseException:
            self._seal()
            raise
        results = [ended[r] for r in serving]
        return step_stats(start, t0, results[: len(self.workers)], results[len(self.workers) :])

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

    def _raise_ended(self, serving: list[Any], timeout: float, servers_only: bool = False) -> bool:
        """Raise the error of a serve call that ended with one (an exception or a death),
        waiting up to ``timeout`` for one to end. Returns whether a call ended normally.

        ``servers_only``: while the servers apply a chunk's last step, the workers' calls have
        ended normally; only the servers' calls are watched."""
        import ray  # noqa: PLC0415

        k = len(self.workers)
        watch = list(serving[k:] if servers_only else serving)
        deadline = time.monotonic() + timeout
        normal = False
        while watch:
            left = max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(watch, num_returns=1, timeout=left)
            if not ready:
                break
            watch.remove(ready[0])
            i = serving.index(ready[0])
            if i < k:
                get_all(ready, "worker", self.group, indices=[i])
            else:
                get_all(ready, "server", indices=[i - k])
            normal = True
        return normal

    def _check(self, serving: list[Any], servers_only: bool = False) -> None:
        """Run while a doorbell is silent. A call that ended normally is fine when it rang its
        last message first (a chunk's last step: a worker done before another is still
        computing); one that still has not been heard from long after is a lost message."""
        if not self._raise_ended(serving, timeout=0, servers_only=servers_only):
            return
        now = time.monotonic()
        if self._ended_since is None:
            self._ended_since = now
        elif now - self._ended_since > ENDED_GRACE_S:
            raise RuntimeError("a role stopped serving before its last step")

    def _failed(self, serving: list[Any], servers_only: bool = False) -> None:
        """A role rang 'failed': its serve call is ending with the error; raise that error."""
        self._raise_ended(serving, timeout=60, servers_only=servers_only)
        raise RuntimeError("a role reported a failure, but no call ended with it in 60 s")

    def _ring_workers(self, step: int, serving: list[Any]) -> list[tuple[dict, None]]:
        """Ring every worker for ``step``; what each measured, in worker order."""
        self._ring(self.bells["go_w"], step)
        k = len(self.workers)
        self._ended_since = None
        msgs = wait_all(self.bells["done_w"], k, lambda: self._check(serving))
        if any(m.failed for m in msgs):
            self._failed(serving)
        _same_step(msgs, step)
        in_order = sorted(msgs, key=lambda m: m.part)  # worker order, whatever the arrival order
        return [({f: getattr(m, f) for f in WorkerDone.STATS}, None) for m in in_order]

    def _ring_servers(self, step: int, serving: list[Any]) -> list[float]:
        """Ring every server for ``step``; the seconds each spent."""
        self._ring(self.bells["go_s"], step)
        self._ended_since = None
        msgs = wait_all(self.bells["done_s"], len(self.servers), lambda: self._check(serving, True))
        if any(m.failed for m in msgs):
            self._failed(serving, servers_only=True)
        _same_step(msgs, step)
        return [m.seconds for m in msgs]


def step_stats(
    start: int,
    t0: float,
    workers: list[list[dict[str, float]]],
    servers: list[list[tuple[float, float, float]]],
) -> list[StepStats]:
    """Each step's timings, from the workers' (what each measured) and the servers' (when
    rung for, when done, seconds) of roles that ring one another; a step starts when its
    last server's go went out (the first, ``t0``, when the stub's)."""
    out = []
    for j, per_server in enumerate(zip(*servers, strict=True)):
        heard = min(h for h, _, _ in per_server)  # the last worker's go reached a server
        end = max(e for _, e, _ in per_server)
        seconds = [sec for _, _, sec in per_server]
        out.append(step_record(start + j, [w[j] for w in workers], t0, heard, heard, end, seconds))
        t0 = end
    return out


def step_record(
    step: int,
    stats: list[dict[str, float]],
    t0: float,
    t1: float,
    t2: float,
    t3: float,
    seconds: list[float],
    norm: float | None = None,
) -> StepStats:
    """One step's timings from what its workers measured (``stats``) and when (wall clock)
    it started (``t0``), its workers were heard (``t1``), their gradients summed (``t2``)
    and its servers were done (``t3``), ``seconds`` their own times."""
    fetch = max(st["fetch"] for st in stats)
    compute = max(st["compute"] for st in stats)
    return StepStats(
        step=step,
        loss=sum(st["loss"] for st in stats),
        fetch=fetch,
        compute=compute,
        gather=t1 - t0 - fetch - compute,
        # where "gather" goes: reaching the last worker, and hearing back from it
        dispatch=max(st["start"] for st in stats) - t0,
        collect=t1 - max(st["end"] for st in stats),
        average=t2 - t1,
        update=t3 - t2,
        server=max(seconds),
        total=t3 - t0,
        grad_norm=norm,
    )


def _same_step(msgs: list[Any], step: int) -> None:
    wrong = sorted({m.step for m in msgs} - {step})
    if wrong:
        raise RuntimeError(f"a done message of step {wrong[0]} came while step {step} ran")
