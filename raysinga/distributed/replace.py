"""A lost worker, stub or server of a synchronous group, replaced alone while every other role
keeps its process, buffers and state.

A worker's batch and randomness are functions of seed, step and part, and a stub's buffer holds
one step's summed gradient. A worker's own state (batch norm's running statistics) is copied
into its shared buffer after every step, tagged with the step it is the state at the start of
(:func:`actors.common.protocol.worker_buffer_layout`); the stub maps that buffer. So the group needs
only a new role in the lost one's place, started from the lost worker's copy, and redoes the
step it was interrupted in from the servers' update count (its live workers take their own
copies of that step back). A server holds state: a new one is rebuilt from the copy of the lost
one that the group's stub keeps, and the summed gradients the stub logged since
(:mod:`actors.memory.replay`). Spares waiting on the group's node and on a standby node
(:mod:`.spares`) take the lost roles' places, so that no process need be started.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, NamedTuple

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group_table

from raysinga.actors.common.errors import get_all
from raysinga.data.cursor import DataCursor

from .role_group import RoleGroup
from .spares import Spares, live_nodes


class Replacer:
    """Replaces lost workers, stubs and servers of one role group's groups."""

    def __init__(self, roles: RoleGroup, spares: bool) -> None:
        self.roles = roles
        self.spares = Spares(roles, spares)
        # nodes the run found unreachable (Ray's id -> address): Ray counts them alive, so it
        # moves nothing off them; the replacement does (RoleGroup.relocate)
        self.avoid: dict[str, str] = {}

    def prepare(self) -> None:
        """Spawn the missing spares, in the background (:meth:`Spares.prepare`)."""
        self.spares.prepare(set(self.avoid))

    # ------------------------------------------------------------------ replacing
    def replace(self, g: int, cursor: DataCursor, done: int, timeout_s: float = 20.0) -> Replaced:
        """Replace the lost workers, servers and the stub of group ``g`` in place. A lost
        server is rebuilt from its newest copy and the stub's log of the steps since. Returns
        the step the group stands at (the servers' update count). Raises
        :class:`ReplaceFailed`, saying why, where that cannot be done (the caller then
        restarts every role): a lost node's bundles find no room on the live nodes, a server
        was lost with the stub (its log went too) or has no copy to rebuild from, the servers
        disagree on the step (a stub lost between two servers' updates of one step), or a
        role does not answer within ``timeout_s``.

        Of several (asynchronous) groups, only group ``g``'s workers and stub are replaced,
        while the others run on; it goes on from the first step of it that not every server
        has applied (at least ``done``, the step its last finished chunk ended at). A lost
        server then restarts every role: its updates interleave every group's, so no log
        replays them."""
        roles = self.roles
        t0 = time.perf_counter()
        sync = len(roles.stubs) == 1
        stopped = self._stop_serving(g, timeout_s, servers=sync)
        if stopped is None:
            raise ReplaceFailed(f"a role of group {g} or a server did not stop in {timeout_s:g} s")
        lost, lost_servers = stopped
        t1 = time.perf_counter()
        if lost_servers and not roles.replay:
            raise ReplaceFailed("a server was lost and the stub logs no steps to rebuild it from")
        stub_lost = not answers(roles.stubs[g], timeout_s)
        if lost_servers and stub_lost:
            raise ReplaceFailed("a server was lost with the stub, and its copy and log with it")
        alive = live_nodes() - set(self.avoid)
        self.spares.drop_off(alive)
        was_on = {roles.worker_infos[g][i]["node"] for i in lost}
        was_on |= {roles.server_infos[k]["node"] for k in lost_servers}
        was_on |= {roles.stub_infos[g]["node"]} if stub_lost else set()
        nodes_lost = len(was_on - alive)
        # A lost node's bundles move to live nodes with room (Ray does so at once), and the
        # new roles go where their bundles now are; with no room left, the elastic rules
        # place a smaller topology instead.
        if was_on & set(self.avoid) and not roles.relocate(
            set(self.avoid), RESCHEDULE_S, self.spares.standby
        ):
            raise ReplaceFailed("the live nodes have no room for what the unreachable ones held")
        if nodes_lost and not _rescheduled(roles.placement.pg, RESCHEDULE_S):
            raise ReplaceFailed(
                f"Ray did not move the lost node's bundles to a live node in {RESCHEDULE_S:g} s"
            )
        roles.replaced = True  # the lost roles' shared files go at shutdown, by tag
        new_servers = {k: self.new_server(k) for k in lost_servers}  # they start meanwhile
        roles.spares += new_servers.values()  # stopped with the others, whatever comes next
        new_workers = {}
        for i in lost:
            worker, info = self._take_worker(g, i, roles.worker_infos[g][i]["node"], timeout_s)
            new_workers[i] = (worker, info)
        t2 = time.perf_counter()
        replayed = self._rebuild(g, new_servers, timeout_s) if new_servers else 0
        sizes = get_all([roles.stubs[g].replay_sizes.remote()], "stub", g)[0] if new_servers else {}
        t3 = time.perf_counter()
        at = self._sync_position() if sync else self.async_position(g, done)
        if at is None:
            raise ReplaceFailed(f"the servers {DISAGREE}")
        # A new worker starts from the lost one's state at the step the group redoes (batch
        # norm's running statistics, copied after every step into its buffer, which the stub
        # maps); a stub lost too took that with it.
        with_state = bool(roles.plan.state_names) and bool(lost)
        if with_state and stub_lost:
            raise ReplaceFailed("the lost workers' own state went with the stub")
        for i, (worker, info) in new_workers.items():
            state = {}
            if with_state:
                state = get_all([roles.stubs[g].worker_state.remote(i, at)], "stub", g)[0]
                if state is None:
                    raise ReplaceFailed(f"the stub holds no state of worker {i} at step {at}")
            get_all([worker.restore.remote(state, cursor)], "worker", g)
            roles.workers[g][i], roles.worker_infos[g][i] = worker, info
        roles.publish_where_read()
        stub = self._take_stub(g, timeout_s) if stub_lost else roles.stubs[g]
        if stub_lost:
            roles.stub_infos[g] = get_all([stub.describe.remote()], "stub", g)[0]
        rewire = stub.rewire.remote(
            roles.workers[g], roles.worker_infos[g], roles.servers, roles.server_infos
        )
        get_all([rewire], "stub", g)
        roles.stubs[g] = stub
        keeper_lost = stub_lost and g == 0  # group 0's stub keeps the servers' copies
        if keeper_lost or new_servers:
            roles.keep_copies(list(range(len(roles.servers))) if keeper_lost else list(new_servers))
        t4 = time.perf_counter()
        phases = {"stop_s": t1 - t0, "respawn_s": t2 - t1, "rebuild_s": t3 - t2}
        phases["rewire_s"] = t4 - t3
        phases["nodes_lost"] = nodes_lost
        phases.update({k: v for k, v in sizes.items() if k.endswith("bytes")})
        return Replaced(at, phases, sorted(new_servers), replayed)

    def _sync_position(self) -> int | None:
        """Where the synchronous group stands: the servers' update count, which must be the
        same on every server (else a stub died between two servers' updates of one step)."""
        versions = {
            v for v, _ in get_all([s.latest.remote() for s in self.roles.servers], "server")
        }
        return versions.pop() if len(versions) == 1 else None

    def async_position(self, g: int, done: int) -> int:
        """Where asynchronous group ``g`` stands: the first of its steps some server has not
        applied (a server that has goes past it when the group redoes it)."""
        firsts = get_all([s.next_step.remote(g) for s in self.roles.servers], "server")
        return max(done, min((f for f in firsts if f is not None), default=done))

    def new_server(self, k: int) -> Any:
        """Server ``k``'s spare (:meth:`Spares.take_server`); else a new one in the lost one's
        bundle. (A spare that died is found out by the rebuild's first call, and the loss then
        restarts every role.)"""
        spare = self.spares.take_server(k)
        return spare if spare is not None else self.roles.spawn_server(k)

    def _rebuild(self, g: int, new: dict[int, Any], timeout_s: float) -> int:
        """Bring each new server in ``new`` (by lost index) to the live servers' version (with
        none alive, the newest step the stub logged) from its copy and the stub's log; the
        new servers then stand in the lost ones' places. Returns the steps replayed (the most
        of any server); raises :class:`ReplaceFailed` where the live servers disagree on the
        step or a server has nothing to rebuild from."""
        roles = self.roles
        live = [s for k, s in enumerate(roles.servers) if k not in new]
        versions = {v for v, _ in get_all([s.latest.remote() for s in live], "server")}
        if len(versions) > 1:
            raise ReplaceFailed(f"the live servers {DISAGREE}")
        target = versions.pop() if versions else None
        infos = get_all(
            [a.describe.remote() for a in new.values()], "server", None, timeout_s, list(new)
        )
        stub, most = roles.stubs[g], 0
        for (k, actor), info in zip(new.items(), infos, strict=True):
            n = get_all([stub.rebuild.remote(k, actor, target)], "stub", g)[0]
            if n is None:
                raise ReplaceFailed(
                    f"server {k}: no copy of it, or the log does not reach back to it"
                )
            roles.servers[k], roles.server_infos[k], most = actor, info, max(most, n)
        return most

    def _stop_serving(
        self, g: int, timeout_s: float, servers: bool
    ) -> tuple[list[int], list[int]] | None:
        """Bring the group's workers and (``servers``) the servers out of their serve loops
        (they may wait for a stub that is gone); returns the indices of the group's lost
        workers and of the lost servers, or None if a role does not answer."""
        roles = self.roles
        group = [*roles.workers[g], *(roles.servers if servers else [])]
        aborts = [a.abort.options(concurrency_group="control").remote() for a in group]
        # Each abort applied (or its role found gone) before the flag is cleared: a clear that
        # overtook its abort would leave the flag set, and the next chunk would abort itself.
        done, _ = ray.wait(aborts, num_returns=len(aborts), timeout=timeout_s)
        for ref in done:  # fetched, so that Ray reports no unhandled error for the lost
            with contextlib.suppress(Exception):
                ray.get(ref)
        if len(done) < len(aborts):
            return None
        clears = [a.clear_abort.remote() for a in group]  # once its serve loop has ended
        ready, _ = ray.wait(clears, num_returns=len(clears), timeout=timeout_s)
        if len(ready) < len(clears):
            return None
        lost: tuple[list[int], list[int]] = ([], [])
        n = len(roles.workers[g])
        for k, ref in enumerate(clears):
            try:
                ray.get(ref)
            except RayActorError:
                lost[k >= n].append(k - n if k >= n else k)
        return lost

    def _take_worker(
        self, g: int, i: int, node: str, timeout_s: float
    ) -> tuple[Any, dict[str, Any]]:
        """A spare, ready, in the place of worker ``i`` (which ran on ``node``;
        :meth:`Spares.take_worker`); else a new one in the lost one's bundle."""
        spare, kept = self.spares.take_worker(g, i, node)
        info = spare.ready(timeout_s) if spare is not None else None
        if spare is not None and info is not None:
            if info.get("gpus") == self.roles.worker_infos[g][i].get("gpus"):
                with contextlib.suppress(RayActorError):
                    get_all([spare.actor.adopt.remote(i)], "worker", g)
                    return spare.actor, info
            else:  # it sees another GPU than the lost worker's: it waits for a loss there
                kept[g] = spare
        actor = self.roles.spawn_worker(g, i)
        try:
            return actor, get_all([actor.describe.remote()], "worker", g, timeout_s)[0]
        except GetTimeoutError as e:
            raise ReplaceFailed(f"worker {i} of group {g}: no answer in {timeout_s:g} s") from e

    def _take_stub(self, g: int, timeout_s: float) -> Any:
        """The spare stub, ready; else a new one in the lost one's bundle."""
        ray.kill(self.roles.stubs[g])
        spare = self.spares.take_stub(g, timeout_s)
        if spare is not None:
            return spare
        actor = self.roles.spawn_stub(g)
        try:
            get_all([actor.describe.remote()], "stub", g, timeout_s)
        except GetTimeoutError as e:
            raise ReplaceFailed(f"the stub of group {g}: no answer in {timeout_s:g} s") from e
        return actor


def replay_steps(fault: Any, shapes: dict[str, tuple[int, ...]], dtype: str) -> int:
    """How many steps' summed gradients a stub logs to rebuild a lost server: within
    ``fault.replay_steps`` and ``fault.replay_mb`` (0: no log, a lost server restarts every
    role; at least 2, as the servers copy themselves every half of it)."""
    n = min(fault.replay_steps, fault.replay_mb * 2**20 // max(1, grad_nbytes(shapes, dtype)))
    return n if n >= 2 else 0


def grad_nbytes(shapes: dict[str, tuple[int, ...]], dtype: str) -> int:
    """The bytes of one step's summed gradient (all parameters)."""
    return sum(int(np.prod(s)) for s in shapes.values()) * np.dtype(dtype).itemsize


class Replaced(NamedTuple):
    """A replacement done: the step the group stands at, the seconds of each phase, the
    servers rebuilt and the most steps replayed into one of them; after a rebuild of a server
    of asynchronous groups, the step every group stands at."""

    at: int
    phases: dict[str, float]
    rebuilt: list[int]
    replayed: int
    positions: dict[int, int] | None = None


class ReplaceFailed(RuntimeError):
    """The lost roles cannot be replaced alone (the message says why): the run restarts
    every role from the newest committed checkpoint instead."""


RESCHEDULE_S = 5.0  # how long a lost node's bundles may take to move to a live node
DISAGREE = "disagree on the step (the stub was lost between two servers' updates of one step)"


def _rescheduled(pg: Any, timeout_s: float) -> bool:
    """Whether Ray has moved every bundle of ``pg`` off dead nodes within ``timeout_s`` (it
    does at once where a live node has room; otherwise the group waits as rescheduling)."""
    deadline = time.monotonic() + timeout_s
    while True:
        table = placement_group_table(pg)
        alive = live_nodes()
        where = table.get("bundles_to_node_id", {}).values()
        if table.get("state") == "CREATED" and all(n in alive for n in where):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def answers(actor: Any, timeout_s: float) -> bool:
    """Whether a role answers within ``timeout_s`` (False: it is gone, or hangs)."""
    try:
        ray.get(actor.describe.remote(), timeout=timeout_s)
        return True
    except (RayActorError, GetTimeoutError):
        return False
