"""A lost worker, stub or server of a synchronous group, replaced alone while every other role
keeps its process, buffers and state.

A worker's batch and randomness are functions of seed, step and part, and a stub's buffer holds
one step's summed gradient. A worker's own state (batch norm's running statistics) is copied
into its shared buffer after every step, tagged with the step it is the state at the start of
(:func:`actors.protocol.worker_buffer_layout`); the stub maps that buffer. So the group needs
only a new role in the lost one's place, started from the lost worker's copy, and redoes the
step it was interrupted in from the servers' update count (its live workers take their own
copies of that step back). A server holds state: a new one is rebuilt from the copy of the lost
one that the group's stub keeps, and the summed gradients the stub logged since
(:mod:`actors.replay`). Starting a role costs a Python process, its imports and its copy of the
data (about a second on two loaded cores), so each group keeps a spare worker, a spare stub and
a spare of each server on its node, idle until one takes over; a new spare is then spawned in
the background.

A GPU role costs more to start: a CUDA context, its kernels compiled or loaded, its memory pool
grown. Its spare sees the same GPU as the roles it may replace (holding no GPU of Ray's, it
takes the share the lost role leaves) and, once up, runs one step of its kind on scratch data
and drops the result (:meth:`Worker.warm`, :meth:`ParamServer.warm`), so that it takes over
ready.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, NamedTuple

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group_table

from raysinga.actors.errors import get_all
from raysinga.data.cursor import DataCursor

from .role_group import RoleGroup


class Replacer:
    """Replaces lost workers, stubs and servers of one role group's groups."""

    def __init__(self, roles: RoleGroup, spares: bool) -> None:
        self.roles, self.use_spares = roles, spares
        # group -> a spare on the node of the group's stub
        self.spare_worker: dict[int, Spare] = {}
        self.spare_stub: dict[int, Spare] = {}
        # server index -> a spare on the stub's node, for a server rebuilt from its copy
        self.spare_server: dict[int, Spare] = {}
        # nodes the run found unreachable (Ray's id -> address): Ray counts them alive, so it
        # moves nothing off them; the replacement does (RoleGroup.relocate)
        self.avoid: dict[str, str] = {}
        # A node with room for a worker's bundle and none of the run's roles, where a lost
        # node's bundles go first, and spares for its roles wait: a worker of each group, and
        # each server that is not on the stub's node (those have their spares there).
        self.standby: str | None = None
        self.far_worker: dict[int, Spare] = {}
        self.far_server: dict[int, Spare] = {}
        self.t_standby = -STANDBY_EVERY_S  # when a standby node was last looked for

    def prepare(self) -> None:
        """Spawn each group's missing spares, in the background (not waited for): a worker
        and a stub on the group's node, and where servers are rebuilt from copies, one for
        each server on the stub's node."""
        if self.use_spares:
            for g in range(len(self.roles.stubs)):
                if g not in self.spare_worker:
                    self._spare_worker(g)
                if g not in self.spare_stub:
                    self._spare_stub(g)
            if self.roles.replay:
                node = self.roles.stub_infos[0]["node"]
                for k, info in enumerate(self.roles.server_infos):
                    if k not in self.spare_server and info["node"] == node:
                        self.spare_server[k] = self._spare(
                            "server", node, self.roles.server_spec(k), gpus=info.get("gpus")
                        )
            self._prepare_standby()

    def _prepare_standby(self) -> None:
        """Spares on the standby node (found again where it is gone, or now holds roles; looked
        for at most every ``STANDBY_EVERY_S`` where there is none): a worker of each group, and
        where servers are rebuilt from copies, each server not on the stub's node."""
        roles = self.roles
        used = {i["node"] for i in [*roles.server_infos, *roles.stub_infos]}
        used |= {i["node"] for row in roles.worker_infos for i in row}
        if self.standby is not None and (
            self.standby in used or self.standby in self.avoid or self.standby not in live_nodes()
        ):
            self.standby = None
            self.far_worker.clear()  # left waiting; stopped with the run's other spares
            self.far_server.clear()
        if self.standby is None and time.monotonic() - self.t_standby >= STANDBY_EVERY_S:
            self.t_standby = time.monotonic()
            self.standby = _free_node(roles.topo.worker.as_bundle(), used | set(self.avoid))
        if self.standby is None:
            return
        for g in range(len(roles.stubs)):
            if g not in self.far_worker:
                gpus = roles.worker_infos[g][0].get("gpus")
                self.far_worker[g] = self._spare(
                    "worker", self.standby, roles.worker_spec(g, 0), gpus=gpus
                )
        if roles.replay:
            stub_node = roles.stub_infos[0]["node"]
            for k, info in enumerate(roles.server_infos):
                if k not in self.far_server and info["node"] != stub_node:
                    self.far_server[k] = self._spare(
                        "server", self.standby, roles.server_spec(k), gpus=info.get("gpus")
                    )

    def _spare_worker(self, g: int) -> None:
        roles = self.roles
        self.spare_worker[g] = self._spare(
            "worker",
            roles.stub_infos[g]["node"],
            roles.worker_spec(g, 0),
            gpus=roles.worker_infos[g][0].get("gpus"),
        )

    def _spare_stub(self, g: int) -> None:
        roles = self.roles
        self.spare_stub[g] = self._spare("stub", roles.stub_infos[g]["node"], *roles.stub_args(g))

    def _spare(self, role: str, node: str, *args: Any, gpus: str | None = None) -> Spare:
        """A spare ``role`` on ``node``; one of a GPU worker or server (seeing ``gpus``) warms
        up once started (its calls run in order: a take-over waits for the warm-up). A CPU
        spare has nothing to compile and starts its first step at once."""
        actor = self.roles.spawn_spare(role, node, *args, gpus=gpus)
        described, warmed = actor.describe.remote(), None
        if gpus is not None and role == "server":
            warmed = actor.warm.remote(self.roles.plan.updater)
        elif gpus is not None and role == "worker":
            warmed = actor.warm.remote()
        return Spare(actor, described, node, warmed)

    def drop_spares_off(self, alive: set[str]) -> None:
        """Forget the spares that were on a node now gone (they went with it)."""
        for spares in (
            self.spare_worker,
            self.spare_stub,
            self.spare_server,
            self.far_worker,
            self.far_server,
        ):
            for key in [key for key, s in spares.items() if s.node not in alive]:
                del spares[key]

    # ------------------------------------------------------------------ replacing
    def replace(
        self, g: int, cursor: DataCursor, done: int, timeout_s: float = 20.0
    ) -> Replaced | None:
        """Replace the lost workers, servers and the stub of group ``g`` in place. A lost
        server is rebuilt from its newest copy and the stub's log of the steps since. Returns
        the step the group stands at (the servers' update count), or None where that cannot
        be done: a lost node's bundles find no room on the live nodes, a server was lost with
        the stub (its log went too) or has no copy to rebuild from, the servers disagree on
        the step (a stub lost between two servers' updates of one step), or a role does not
        answer within ``timeout_s`` (the caller then restarts every role).

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
            return None
        lost, lost_servers = stopped
        t1 = time.perf_counter()
        if lost_servers and not roles.replay:
            return None
        stub_lost = not answers(roles.stubs[g], timeout_s)
        if lost_servers and stub_lost:
            return None  # the copies and the log went with the stub
        alive = live_nodes() - set(self.avoid)
        self.drop_spares_off(alive)
        was_on = {roles.worker_infos[g][i]["node"] for i in lost}
        was_on |= {roles.server_infos[k]["node"] for k in lost_servers}
        was_on |= {roles.stub_infos[g]["node"]} if stub_lost else set()
        nodes_lost = len(was_on - alive)
        # A lost node's bundles move to live nodes with room (Ray does so at once), and the
        # new roles go where their bundles now are; with no room left, the elastic rules
        # place a smaller topology instead.
        if was_on & set(self.avoid) and not roles.relocate(
            set(self.avoid), RESCHEDULE_S, self.standby
        ):
            return None
        if nodes_lost and not _rescheduled(roles.placement.pg, RESCHEDULE_S):
            return None
        roles.replaced = True  # the lost roles' shared files go at shutdown, by tag
        new_servers = {k: self.new_server(k) for k in lost_servers}  # they start meanwhile
        roles.spares += new_servers.values()  # stopped with the others, whatever comes next
        new_workers = {}
        for i in lost:
            worker, info = self._take_worker(g, i, roles.worker_infos[g][i]["node"], timeout_s)
            new_workers[i] = (worker, info)
        t2 = time.perf_counter()
        replayed = self._rebuild(g, new_servers, timeout_s) if new_servers else 0
        if replayed is None:
            return None
        sizes = get_all([roles.stubs[g].replay_sizes.remote()], "stub", g)[0] if new_servers else {}
        t3 = time.perf_counter()
        at = self._sync_position() if sync else self.async_position(g, done)
        if at is None:
            return None
        # A new worker starts from the lost one's state at the step the group redoes (batch
        # norm's running statistics, copied after every step into its buffer, which the stub
        # maps); a stub lost too took that with it.
        with_state = bool(roles.plan.state_names) and bool(lost)
        if with_state and stub_lost:
            return None
        for i, (worker, info) in new_workers.items():
            state = {}
            if with_state:
                state = get_all([roles.stubs[g].worker_state.remote(i, at)], "stub", g)[0]
                if state is None:
                    return None
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
        """Server ``k``'s spare, where it waits on the lost one's node (the stub's); else a
        new one in the lost one's bundle. (A spare that died is found out by the rebuild's
        first call, and the loss then restarts every role.)"""
        spare = self.spare_server.pop(k, None)
        if (
            spare is not None
            and self.roles.server_infos[k]["node"] == self.roles.stub_infos[0]["node"]
        ):
            return spare.actor
        far = self.far_server.get(k)
        if far is not None and self._bundle_node(self.roles.placement.servers[k]) == far.node:
            return self.far_server.pop(k).actor  # the lost node's bundle moved to the standby
        return self.roles.spawn_server(k)

    def _bundle_node(self, bundle: int) -> str:
        return self.roles.bundle_nodes().get(bundle, "")

    def _rebuild(self, g: int, new: dict[int, Any], timeout_s: float) -> int | None:
        """Bring each new server in ``new`` (by lost index) to the live servers' version (with
        none alive, the newest step the stub logged) from its copy and the stub's log; the
        new servers then stand in the lost ones' places. Returns the steps replayed (the most
        of any server), or None where a server has nothing to rebuild from."""
        roles = self.roles
        live = [s for k, s in enumerate(roles.servers) if k not in new]
        versions = {v for v, _ in get_all([s.latest.remote() for s in live], "server")}
        if len(versions) > 1:
            return None
        target = versions.pop() if versions else None
        infos = get_all(
            [a.describe.remote() for a in new.values()], "server", None, timeout_s, list(new)
        )
        stub, most = roles.stubs[g], 0
        for (k, actor), info in zip(new.items(), infos, strict=True):
            n = get_all([stub.rebuild.remote(k, actor, target)], "stub", g)[0]
            if n is None:
                return None
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
        """The spare worker, ready, in the place of worker ``i`` (which ran on ``node``);
        else a new one in the lost one's bundle. A spare waits on the stub's node: where the
        lost worker ran elsewhere, the new one goes where it was, so that no node takes on
        more than it was given."""
        on_node = self.roles.stub_infos[g]["node"] == node
        kept = self.spare_worker
        far = self.far_worker.get(g)
        if not on_node and far is not None:  # the lost node's bundle moved to the standby
            if self._bundle_node(self.roles.placement.workers[g][i]) == far.node:
                kept = self.far_worker
        spare = kept.pop(g, None) if on_node or kept is self.far_worker else None
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
        spare = self.spare_stub.pop(g, None)
        if spare is not None and spare.ready(timeout_s) is not None:
            return spare.actor
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
    """A replacement did not come up in time: the run restarts every role instead."""


class Spare(NamedTuple):
    """An idle role waiting to take over from a lost one: the actor, its ``describe()`` ref,
    the node it waits on, and (a GPU role's) its ``warm()`` ref."""

    actor: Any
    described: Any
    node: str
    warmed: Any = None

    def ready(self, timeout_s: float) -> dict[str, Any] | None:
        """What it says of itself once up and warm; None where it died, its warm-up failed or
        it did not come up in time (then a new role is started in the lost one's bundle
        instead). A warm-up still running after ``timeout_s`` (kernels compiled for the first
        time) does not count against it: the take-over's calls run after it."""
        try:
            info = ray.get(self.described, timeout=timeout_s)
        except (RayError, GetTimeoutError):
            return None
        if self.warmed is not None:
            try:
                ray.get(self.warmed, timeout=timeout_s)
            except GetTimeoutError:
                pass
            except RayError:
                return None
        return info


RESCHEDULE_S = 5.0  # how long a lost node's bundles may take to move to a live node
STANDBY_EVERY_S = 10.0  # how often a run without a standby node looks for one


def _free_node(bundle: dict[str, float], taken: set[str]) -> str | None:
    """A live node outside ``taken`` with room for ``bundle`` now (Ray's available
    resources), or None."""
    from ray._private import state  # noqa: PLC0415 - per node: no public getter

    try:
        free = state.available_resources_per_node()
    except Exception:  # noqa: BLE001 - Ray's internals moved: no standby node
        return None
    for node in sorted(live_nodes() - taken):
        room = free.get(node, {})
        if all(room.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items()):
            return node
    return None


def live_nodes() -> set[str]:
    """The Ray nodes alive now (their ids)."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


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
