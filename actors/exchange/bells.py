"""The doorbells of one synchronous group whose roles all share the stub's node: the per-step
control path that takes no Ray call.

Each worker and server runs one ``serve`` call for a whole chunk of steps. The stub rings each
step's go and waits for their done messages in shared memory; or, where the servers sum the
gradients, the roles ring one another and the stub only starts the chunk and waits for their
calls to return. A :class:`Stub` owns one :class:`GroupBells` while its group is wired so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ..common.errors import get_all, settle
from ..common.protocol import Go, ServerDone, StepStats, Wiring, WorkerDone
from .doorbell import Doorbell, Message, wait_all

ENDED_GRACE_S = 5.0  # how long a doorbell may stay silent after a serve call ended normally


class GroupBells:
    """Doorbells named after ``base`` (the stub's shared buffer): a go bell per worker and per
    server, one done bell for the workers and one for the servers. ``workers`` and ``servers``
    are the role handles, ``server_handles`` what each server's ``serve`` call reads."""

    def __init__(
        self,
        base: str,
        group: int,
        workers: list[Any],
        servers: list[Any],
        server_handles: list[Any],
    ) -> None:
        self.group, self.workers, self.servers = group, workers, servers
        self.server_handles = server_handles

        def bell(suffix: str, message: type[Message]) -> Doorbell[Message]:
            return Doorbell(Doorbell.create(f"{base}-{suffix}"), message)

        self.go_w = [bell(f"go-w{i}", Go) for i in range(len(workers))]
        self.go_s = [bell(f"go-s{k}", Go) for k in range(len(servers))]
        self.done_w = bell("done-w", WorkerDone)
        self.done_s = bell("done-s", ServerDone)
        self.chunk = 0  # the chunk being served: tells its go messages from a failed one's
        self.serving: list[Any] = []  # the serve calls of that chunk
        self._ended_since: float | None = None  # when a serve call was first seen ended

    def close(self) -> None:
        # A failed chunk's other serve calls end once the recovery aborts them: their errors
        # are fetched, not left for Ray to print (a chunk that ended well: fetched already).
        settle(self.serving)
        self.serving = []
        for bell in [*self.go_w, *self.go_s, self.done_w, self.done_s]:
            bell.close()
            if os.path.exists(bell.path):
                os.unlink(bell.path)

    def start_serving(
        self, chunk: int, start: int, stop: int, summing: bool, grads: Any, epoch: int = 0
    ) -> list[Any]:
        """Start every worker's and server's ``serve`` call for steps ``start .. stop-1`` of
        chunk number ``chunk``, stamped with the stub's ``epoch`` (:mod:`.fence`); the servers
        read each step's gradient from ``grads``. Where
        the servers sum the gradients (``summing``) the roles ring one another (the stub
        starts the chunk, :meth:`run_alone`); else the stub rings every hand-over itself."""
        self.chunk = chunk
        go_w = [b.path for b in self.go_w]
        go_s = [b.path for b in self.go_s]
        n_w, n_s = len(self.workers), len(self.servers)
        if summing:  # no done messages: each serve call returns what it measured
            to_w = [Wiring(chunk, p, "", n_s, tuple(go_s)) for p in go_w]
            to_s = [Wiring(chunk, p, "", n_w, tuple(go_w), 1) for p in go_s]
        else:
            to_w = [Wiring(chunk, p, self.done_w.path) for p in go_w]
            to_s = [Wiring(chunk, p, self.done_s.path) for p in go_s]
        refs = [
            w.serve.remote(start, stop, i, n_w, to_w[i], *self.server_handles, epoch=epoch)
            for i, w in enumerate(self.workers)
        ]
        refs += [
            s.serve.remote(start, stop, to_s[k], grads, epoch=epoch)
            for k, s in enumerate(self.servers)
        ]
        self.serving = refs
        return refs

    def _ring(self, bells: list[Doorbell[Any]], step: int, times: int = 1) -> None:
        go = Go(step, self.chunk)
        for bell in bells:
            for _ in range(times):
                bell.ring(go)

    def run_alone(
        self, start: int, serving: list[Any], on_failure: Callable[[], None]
    ) -> list[StepStats]:
        """The chunk ``serving`` (started by :meth:`start_serving` with ``summing``), from
        step ``start``: ring it in, wait for every call to end, and build each step's timings
        from what the roles measured. Where a call fails, ``on_failure`` runs before the error
        is raised (the stub seals a log row a lost server left half-written)."""
        import ray  # noqa: PLC0415

        t0 = time.time()
        self._ring(self.go_w, start, times=len(self.servers))  # each server's, as it were
        ended: dict[Any, Any] = {}  # a call that returned -> what it returned
        k = len(self.workers)
        try:
            while not_done := [r for r in serving if r not in ended]:
                ready, _ = ray.wait(not_done, num_returns=1)
                i = serving.index(ready[0])
                if i < k:
                    ended[ready[0]] = get_all(ready, "worker", self.group, indices=[i])[0]
                else:
                    ended[ready[0]] = get_all(ready, "server", indices=[i - k])[0]
        except BaseException:
            on_failure()
            raise
        results = [ended[r] for r in serving]
        return step_stats(start, t0, results[:k], results[k:])

    def ring_workers(self, step: int, serving: list[Any]) -> list[dict[str, float]]:
        """Ring every worker for ``step``; what each measured, in worker order."""
        self._ring(self.go_w, step)
        self._ended_since = None
        msgs = wait_all(self.done_w, len(self.workers), lambda: self._check(serving))
        if any(m.failed for m in msgs):
            self._failed(serving)
        _same_step(msgs, step)
        in_order = sorted(msgs, key=lambda m: m.part)  # worker order, whatever the arrival order
        return [{f: getattr(m, f) for f in WorkerDone.STATS} for m in in_order]

    def ring_servers(self, step: int, serving: list[Any]) -> list[float]:
        """Ring every server for ``step``; the seconds each spent."""
        self._ring(self.go_s, step)
        self._ended_since = None
        msgs = wait_all(self.done_s, len(self.servers), lambda: self._check(serving, True))
        if any(m.failed for m in msgs):
            self._failed(serving, servers_only=True)
        _same_step(msgs, step)
        return [m.seconds for m in msgs]

    def finish(self, serving: list[Any]) -> None:
        """Wait for a chunk's serve calls, which return once their last step is done."""
        get_all(serving[: len(self.workers)], "worker", self.group)
        get_all(serving[len(self.workers) :], "server")

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
    traffic: dict[tuple[str, str], int] | None = None,
) -> StepStats:
    """One step's timings from what its workers measured (``stats``) and when (wall clock)
    it started (``t0``), its workers were heard (``t1``), their gradients summed (``t2``)
    and its servers were done (``t3``), ``seconds`` their own times; ``traffic`` the bytes it
    moved between nodes by route."""
    fetch = max(st["fetch"] for st in stats)
    compute = max(st["compute"] for st in stats)
    return StepStats(
        step=step,
        loss=sum(st["loss"] for st in stats),
        fetch=fetch,
        compute=compute,
        gather=max(0.0, t1 - t0 - fetch - compute),
        # where "gather" goes: reaching the last worker, and hearing back from it
        dispatch=max(0.0, max(st["start"] for st in stats) - t0),  # 0: a step sent ahead
        collect=t1 - max(st["end"] for st in stats),
        average=t2 - t1,
        update=t3 - t2,
        server=max(seconds),
        total=t3 - t0,
        grad_norm=norm,
        traffic=tuple((a, b, n) for (a, b), n in sorted((traffic or {}).items())),
    )


def _same_step(msgs: list[Any], step: int) -> None:
    wrong = sorted({m.step for m in msgs} - {step})
    if wrong:
        raise RuntimeError(f"a done message of step {wrong[0]} came while step {step} ran")
