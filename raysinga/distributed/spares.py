"""Idle roles kept ready to take a lost one's place, so that a replacement need not start a
process.

Starting a role costs a Python process, its imports and its copy of the data (about a second
on two loaded cores). So each group keeps a spare worker, a spare stub and (where servers are
rebuilt from copies) a spare of each server on its stub's node. A whole node lost takes its
roles' bundles to a node with room: the run keeps one such node as a standby, where none of
its roles run, and waits there with a spare worker of each group and a spare of each server
not on the stub's node; the lost node's bundles are moved there first
(:meth:`RoleGroup.relocate`, Ray's own rescheduling).

A GPU spare sees the same GPU as the roles it may replace (holding no GPU of Ray's, it takes
the share the lost role leaves) and, once up, runs one step of its kind on scratch data and
drops the result (:meth:`Worker.warm`, :meth:`ParamServer.warm`), so that it takes over ready.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, NamedTuple

import ray
from ray.exceptions import GetTimeoutError, RayError

from .role_group import RoleGroup

STANDBY_EVERY_S = 10.0  # how often a run without a standby node looks for one


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


class Spares:
    """The spares of one role group's groups: on each stub's node, and on the standby node."""

    def __init__(self, roles: RoleGroup, enabled: bool) -> None:
        self.roles, self.enabled = roles, enabled
        # group -> a spare on the node of the group's stub
        self.worker: dict[int, Spare] = {}
        self.stub: dict[int, Spare] = {}
        # server index -> a spare on the stub's node, for a server rebuilt from its copy
        self.server: dict[int, Spare] = {}
        # A node with room for a worker's bundle and none of the run's roles, where a lost
        # node's bundles go first, and spares for its roles wait: a worker of each group, and
        # each server that is not on the stub's node (those have their spares there).
        self.standby: str | None = None
        self.far_worker: dict[int, Spare] = {}
        self.far_server: dict[int, Spare] = {}
        self.t_standby = -STANDBY_EVERY_S  # when a standby node was last looked for

    def listed(self) -> list[dict[str, Any]]:
        """Each spare: what it stands in for, its node and (once it is up) its pid, for the
        run's status."""
        tables = (
            ("worker", self.worker, "group"),
            ("stub", self.stub, "group"),
            ("server", self.server, "index"),
            ("worker", self.far_worker, "group"),
            ("server", self.far_server, "index"),
        )
        refs = [sp.described for _, table, _ in tables for sp in table.values()]
        up = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        out = []
        for kind, table, by in tables:
            for key, sp in table.items():
                pid = None
                if sp.described in up:
                    with contextlib.suppress(RayError):  # a spare that died has no pid to show
                        pid = ray.get(sp.described).get("pid")
                out.append({"role": kind, by: key, "node": sp.node, "pid": pid})
        return out

    def ready_count(self) -> int:
        """How many spares are up (their ``describe()`` answered), for the run's metrics."""
        refs = [
            sp.described
            for kind in (self.worker, self.stub, self.server, self.far_worker, self.far_server)
            for sp in kind.values()
        ]
        return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else 0

    def prepare(self, avoid: set[str]) -> None:
        """Spawn each group's missing spares, in the background (not waited for): a worker
        and a stub on the group's node, and where servers are rebuilt from copies, one for
        each server on the stub's node; then those of the standby node (not one of
        ``avoid``, the nodes found unreachable)."""
        if not self.enabled:
            return
        roles = self.roles
        for g in range(len(roles.stubs)):
            node = roles.stub_infos[g]["node"]
            if g not in self.worker:
                gpus = roles.worker_infos[g][0].get("gpus")
                self.worker[g] = self._spawn("worker", node, roles.worker_spec(g, 0), gpus=gpus)
            if g not in self.stub:
                self.stub[g] = self._spawn("stub", node, *roles.stub_args(g))
        if roles.replay:
            node = roles.stub_infos[0]["node"]
            for k, info in enumerate(roles.server_infos):
                if k not in self.server and info["node"] == node:
                    self.server[k] = self._spawn(
                        "server", node, roles.server_spec(k), gpus=info.get("gpus")
                    )
        self._prepare_standby(avoid)

    def _prepare_standby(self, avoid: set[str]) -> None:
        """Spares on the standby node (found again where it is gone, or now holds roles; looked
        for at most every ``STANDBY_EVERY_S`` where there is none): a worker of each group, and
        where servers are rebuilt from copies, each server not on the stub's node."""
        roles = self.roles
        used = {i["node"] for i in [*roles.server_infos, *roles.stub_infos]}
        used |= {i["node"] for row in roles.worker_infos for i in row}
        if self.standby is not None and (
            self.standby in used or self.standby in avoid or self.standby not in live_nodes()
        ):
            self.standby = None
            self.far_worker.clear()  # left waiting; stopped with the run's other spares
            self.far_server.clear()
        if self.standby is None and time.monotonic() - self.t_standby >= STANDBY_EVERY_S:
            self.t_standby = time.monotonic()
            self.standby = free_node(roles.topo.worker.as_bundle(), used | avoid)
        if self.standby is None:
            return
        for g in range(len(roles.stubs)):
            if g not in self.far_worker:
                gpus = roles.worker_infos[g][0].get("gpus")
                self.far_worker[g] = self._spawn(
                    "worker", self.standby, roles.worker_spec(g, 0), gpus=gpus
                )
        if roles.replay:
            stub_node = roles.stub_infos[0]["node"]
            for k, info in enumerate(roles.server_infos):
                if k not in self.far_server and info["node"] != stub_node:
                    self.far_server[k] = self._spawn(
                        "server", self.standby, roles.server_spec(k), gpus=info.get("gpus")
                    )

    def _spawn(self, role: str, node: str, *args: Any, gpus: str | None = None) -> Spare:
        """A spare ``role`` on ``node``; one of a GPU worker or server (seeing ``gpus``) warms
        up once started (its calls run in order: a take-over waits for the warm-up). A CPU
        spare has nothing to compile and starts its first step at once."""
        actor = self.roles.spawn_spare(role, node, *args, gpus=gpus)
        described, warmed = actor.describe.remote(), None
        if gpus is not None and role == "server":
            warmed = actor.warm.remote(self.roles.plan.updater)
        elif gpus is not None and role == "worker":  # on a part of its group's batch
            warmed = actor.warm.remote(len(self.roles.worker_infos[args[0].group]))
        return Spare(actor, described, node, warmed)

    def drop_off(self, alive: set[str]) -> None:
        """Forget the spares that were on a node now gone (they went with it)."""
        for spares in (self.worker, self.stub, self.server, self.far_worker, self.far_server):
            for key in [key for key, s in spares.items() if s.node not in alive]:
                del spares[key]

    # ------------------------------------------------------------------ taking one
    def take_worker(self, g: int, i: int, node: str) -> tuple[Spare | None, dict[int, Spare]]:
        """The spare for worker ``i`` of group ``g``, which ran on ``node``, and the pool it
        was taken from (where it goes back if it cannot take over), or None. One on the
        stub's node replaces a worker that ran there; one on the standby node a worker whose
        node was lost and whose bundle moved there: no node takes on more than it was
        given."""
        roles = self.roles
        if roles.stub_infos[g]["node"] == node:
            return self.worker.pop(g, None), self.worker
        far = self.far_worker.get(g)
        if far is not None and self._bundle_node(roles.placement.workers[g][i]) == far.node:
            return self.far_worker.pop(g), self.far_worker
        return None, self.worker

    def take_server(self, k: int) -> Any | None:
        """Server ``k``'s spare, where it waits on the lost one's node (the stub's), or on the
        standby node that the lost one's bundle moved to; else None."""
        roles = self.roles
        spare = self.server.pop(k, None)
        if spare is not None and roles.server_infos[k]["node"] == roles.stub_infos[0]["node"]:
            return spare.actor
        far = self.far_server.get(k)
        if far is not None and self._bundle_node(roles.placement.servers[k]) == far.node:
            return self.far_server.pop(k).actor
        return None

    def take_stub(self, g: int, timeout_s: float) -> Any | None:
        """Group ``g``'s spare stub, ready; else None."""
        spare = self.stub.pop(g, None)
        if spare is not None and spare.ready(timeout_s) is not None:
            return spare.actor
        return None

    def _bundle_node(self, bundle: int) -> str:
        return self.roles.bundle_nodes().get(bundle, "")


def free_node(bundle: dict[str, float], taken: set[str]) -> str | None:
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
