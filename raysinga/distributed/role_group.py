"""The roles of one placement: spawned, loaded, wired and torn down together.

A :class:`RoleGroup` owns the parameter servers, the workers of every group and the groups'
stubs of one placement group, and every Ray call that reaches all of them at once: describe,
verify and load a checkpoint, snapshot, gather the parameters, shut down. The controller decides
when; this object knows how.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group_table, remove_placement_group

from raysinga.actors import placement
from raysinga.actors.common.errors import get_all
from raysinga.actors.common.protocol import ServerSpec, StubSpec, WorkerSpec
from raysinga.actors.exchange.mirrors import first_on_each_node
from raysinga.kernels.cpu_threads import compute_threads
from raysinga.nn.layers import dw_row_blocks
from raysinga.run.graph_step import graphs_mode

from .role_checkpoints import RoleCheckpoints
from .silence import Role


@dataclass(frozen=True)
class RunPlan:
    """What every placement of a run shares: the parameters, their slicing over the servers,
    the optimizer, the devices, and what progress reports need."""

    shapes: dict[str, tuple[int, ...]]
    slices: list[Any]
    updater: dict[str, Any]
    schedule: Callable[[int], float]  # the learning rate by step
    worker_device: str
    server_device: str
    state_names: list[str]  # the workers' non-trainable state
    n_train: int  # training samples
    run_dir: Path
    chance_loss: float | None = None  # a classifier's loss of a uniform guess (the guard's floor)
    # what every role runs in beyond the job's own runtime environment: the job's modules,
    # where Ray was started by other code than this run's (shipping.role_env)
    role_env: dict[str, Any] | None = None


class RoleGroup(RoleCheckpoints):
    """Servers, workers and stubs of one placement of a run's topology (the calls that take
    and load checkpoints: :class:`.role_checkpoints.RoleCheckpoints`)."""

    def __init__(
        self,
        cfg: Any,
        classes: dict[str, type],
        topo: Any,
        placement: placement.Placement,
        plan: RunPlan,
    ) -> None:
        """``plan``: what every placement of the run shares."""
        self.cfg, self.classes, self.topo, self.placement, self.plan = (
            cfg,
            classes,
            topo,
            placement,
            plan,
        )
        self.tag = f"{cfg.name}-{uuid.uuid4().hex[:8]}"  # names the roles' shared-memory files
        # the run's name where the roles record Ray metrics (metrics.ray), else None
        self.metrics = cfg.name if cfg.metrics.ray else None
        self.servers: list[Any] = []
        self.workers: list[list[Any]] = []
        self.stubs: list[Any] = []
        self.server_infos: list[dict[str, Any]] = []
        self.worker_infos: list[list[dict[str, Any]]] = []
        self.stub_infos: list[dict[str, Any]] = []
        self.seed = 0  # the workers' (the start checkpoint's)
        self.spares: list[Any] = []  # roles spawned to take over from lost ones (replace.py)
        self.replaced = False  # a role was replaced: its shared files are left to remove
        self.replay = 0  # steps a stub logs to rebuild a lost server (replace.replay_steps)
        # bundles of the placement moved off nodes found unreachable: index -> (group, index)
        self.moved: dict[int, tuple[Any, int]] = {}
        self.extra_pgs: list[Any] = []

    @property
    def actors(self) -> list[Any]:
        return [*self.stubs, *(w for row in self.workers for w in row), *self.servers]

    def spawn_spare(self, role: str, node: str, *args: Any, gpus: str | None = None) -> Any:
        """A spare ``role`` on ``node`` (seeing ``gpus``: a GPU role's), idle until it takes
        over from a lost one; stopped with the others."""
        actor = placement.spawn_spare(
            self.classes[role], node, *args, gpus=gpus, env=self.plan.role_env
        )
        self.spares.append(actor)
        return actor

    def _spawn(self, role: str, bundle: int, spec: Any, *more: Any) -> Any:
        res = getattr(self.topo, role)
        pg, index = self.moved.get(bundle, (self.placement.pg, bundle))
        return placement.spawn(
            self.classes[role], pg, index, res, spec, *more, env=self.plan.role_env
        )

    def bundle_nodes(self) -> dict[int, str]:
        """Where each bundle of the placement is now (Ray's node ids), moved ones included."""
        tables: dict[Any, dict] = {}

        def node(pg: Any, i: int) -> str:
            if pg.id not in tables:
                tables[pg.id] = placement_group_table(pg).get("bundles_to_node_id", {})
            return tables[pg.id].get(i, "")

        n = len(self.placement.pg.bundle_specs)
        return {b: node(*self.moved.get(b, (self.placement.pg, b))) for b in range(n)}

    def relocate(self, avoid: set[str], timeout_s: float, prefer: str | None = None) -> bool:
        """Move the bundles on nodes ``avoid`` (found unreachable: Ray still counts them alive,
        so it moves nothing itself) to a placement group of their own on other nodes (node
        ``prefer`` where it has room); the roles spawned in them from now on go there. False
        where no room was found."""
        on = [b for b, node in self.bundle_nodes().items() if node in avoid]
        if not on:
            return True
        specs = [self.placement.pg.bundle_specs[b] for b in on]
        pg = placement.relocated(specs, avoid, timeout_s, prefer)
        if pg is None:
            return False
        self.extra_pgs.append(pg)
        for j, b in enumerate(on):
            self.moved[b] = (pg, j)
        return True

    def watched(self) -> list[Role]:
        """Every role, for the run's heartbeat (:class:`~.silence.Watch`)."""
        out = [Role(s, "stub", g, g, self.stub_infos[g]["node"]) for g, s in enumerate(self.stubs)]
        for g, row in enumerate(self.workers):
            out += [
                Role(w, "worker", i, g, self.worker_infos[g][i]["node"]) for i, w in enumerate(row)
            ]
        out += [
            Role(s, "server", k, None, self.server_infos[k]["node"])
            for k, s in enumerate(self.servers)
        ]
        return out

    def fence(self, epoch: int, timeout_s: float = 20.0) -> None:
        """Tell every role the run's epoch (:mod:`raysinga.actors.exchange.fence`): from now on each
        stamps it on what it sends and refuses what an older one sends."""
        for role, actors in (
            ("stub", self.stubs),
            ("worker", [w for row in self.workers for w in row]),
            ("server", self.servers),
        ):
            calls = [a.fence.options(concurrency_group="control").remote(epoch) for a in actors]
            get_all(calls, role, None, timeout_s)

    # ------------------------------------------------------------------ spawning
    def spawn_servers(self, seed: int) -> None:
        self.seed = seed
        self.servers = [self.spawn_server(k) for k in range(self.topo.n_servers)]

    def spawn_server(self, k: int) -> Any:
        return self._spawn("server", self.placement.servers[k], self.server_spec(k))

    def server_spec(self, k: int) -> ServerSpec:
        plan, cfg = self.plan, self.cfg
        return ServerSpec(
            k,
            cfg.model.to_dict(),
            cfg.dtype,
            self.seed,
            tuple(plan.slices),
            plan.updater,
            self.tag,
            plan.server_device,
            cfg.lr_scale(self.topo),
            self.topo.wire,
            self.topo.reduce == "hosts",
            self.metrics,
        )

    def spawn_workers(self, seed: int) -> None:
        self.seed = seed
        self.workers = [
            [self.spawn_worker(g, i) for i in range(self.topo.workers_per_group)]
            for g in range(self.topo.n_groups)
        ]

    def spawn_worker(self, g: int, i: int) -> Any:
        return self._spawn("worker", self.placement.workers[g][i], self.worker_spec(g, i))

    def worker_spec(self, g: int, i: int) -> WorkerSpec:
        cfg, plan, topo = self.cfg, self.plan, self.topo
        return WorkerSpec(
            i,
            g,
            cfg.model.to_dict(),
            cfg.dtype,
            self.seed,
            cfg.data.source,
            cfg.data.batch_size,
            cfg.data.shuffle,
            tuple(plan.slices),
            topo.n_servers,
            topo.n_groups,
            self.tag,
            plan.worker_device,
            compute_threads(topo.worker.cpus),
            cfg.data.held_out(),
            graphs_mode(cfg.gpu.graphs) if plan.worker_device == "gpu" else "off",
            cfg.precision.compute,
            topo.wire,
            topo.reduce == "hosts",
            self.metrics,
            dw_row_blocks(topo.reduce),
        )

    def describe(self) -> None:
        """Wait for servers and workers to be up; keep what they say of themselves."""
        self.server_infos = get_all([s.describe.remote() for s in self.servers], "server")
        self.worker_infos = [
            get_all([w.describe.remote() for w in row], "worker", g)
            for g, row in enumerate(self.workers)
        ]

    def wire(self, prepare_snapshots: bool) -> None:
        """Tell each server whether readers on other nodes need its values published, and
        spawn the stubs that connect each group's workers to the servers. With
        ``prepare_snapshots``, the servers map their checkpoint images now, in the
        background."""
        if prepare_snapshots:
            get_all([s.prepare_snapshots.remote() for s in self.servers], "server")
        self.publish_where_read()
        self.stubs = [self.spawn_stub(g) for g in range(self.topo.n_groups)]
        self.stub_infos = get_all([s.describe.remote() for s in self.stubs], "stub")

    def publish_where_read(self) -> None:
        """Tell each server whether workers on other nodes read it (it then publishes a
        snapshot of its values after each update); keep the snapshot's ref. Summed by hosts,
        each server pushes its values to the inbox of the first worker of each such node
        instead (:mod:`actors.exchange.mirrors`)."""
        worker_nodes = {w["node"] for row in self.worker_infos for w in row}
        hosts = self.topo.reduce == "hosts"
        firsts = first_on_each_node(w for row in self.worker_infos for w in row)
        order = sorted(worker_nodes | {i["node"] for i in self.server_infos})
        for k, (s, info) in enumerate(zip(self.servers, self.server_infos, strict=True)):
            readers = sorted(worker_nodes - {info["node"]})
            if hosts and all(firsts[n].get("mirror") for n in readers):
                # in turn from the node after the server's: one server into a node at once
                at = order.index(info["node"])
                turn = [order[(at + 1 + j) % len(order)] for j in range(len(order))]
                pushes = [firsts[n]["mirror"]["contact"] for n in turn if n in readers]
                call = s.set_remote_readers.remote(bool(readers), readers, pushes)
            else:
                call = s.set_remote_readers.remote(bool(readers), readers if hosts else None)
            info["ref"] = get_all([call], "server", k)[0]

    def spawn_stub(self, g: int) -> Any:
        return self._spawn("stub", self.placement.stubs[g], *self.stub_args(g))

    def stub_args(self, g: int) -> tuple:
        """What the stub of group ``g`` is made from: its spec, then the group's workers and
        every server, with what they said of themselves."""
        plan, cfg = self.plan, self.cfg
        spec = StubSpec(
            g,
            plan.shapes,
            tuple(plan.slices),
            cfg.dtype,
            cfg.clip_norm,
            self.topo.n_groups,
            self.tag,
            self.replay,
            self.topo.workers_per_host if self.topo.reduce == "hosts" else 0,
            self.topo.wire,
            self.metrics,
        )
        return spec, self.workers[g], self.servers, self.worker_infos[g], self.server_infos

    def keep_copies(self, which: list[int] | None = None) -> None:
        """Where the stub logs its steps, have each server (of ``which``; default all) hand
        it a copy of itself now and every half of the log (:mod:`actors.memory.replay`)."""
        if self.replay:
            ks = list(range(len(self.servers))) if which is None else which
            get_all([self.stubs[0].keep_copies.remote(ks)], "stub", 0)

    # ------------------------------------------------------------------ the end
    def shutdown(self, graceful: bool = True, calls: Any = ()) -> None:
        """Stop every actor and free the placement group; safe to call twice and after
        failures. ``graceful``: each actor first unlinks its shared memory itself (up to 5 s),
        then exits (:func:`exit_gracefully`, up to 5 s more); otherwise (after a lost role, when
        the others may hang on it) they are killed at once. Files not unlinked by their actors
        are removed by tag. ``calls``: refs of calls still running on them, fetched so that Ray
        does not report each as an unhandled error."""
        actors = [*self.actors, *(a for a in self.spares if a not in self.actors)]
        done: list[Any] = []
        if actors and graceful:
            stops = [a.shutdown.remote() for a in actors]
            done, _ = ray.wait(stops, num_returns=len(actors), timeout=5)
            exit_gracefully([a for a, s in zip(actors, stops, strict=True) if s in done])
        for a in actors:
            ray.kill(a)
        if actors and (len(done) < len(actors) or self.replaced):  # files nobody unlinked
            placement.remove_shared_files(self.tag)
        for ref in calls:
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=5)
        if self.placement is not None:
            remove_placement_group(self.placement.pg)
        for pg in self.extra_pgs:
            remove_placement_group(pg)
        self.servers, self.workers, self.stubs, self.spares = [], [], [], []
        self.placement, self.extra_pgs, self.moved = None, [], {}


def exit_gracefully(actors: list[Any], timeout_s: float = 5.0) -> None:
    """End ``actors`` as Ray ends an actor whose handles are gone, and wait (up to
    ``timeout_s``) until they have: a process that exits so hands its node's metrics agent what
    it recorded since its last report (:mod:`raysinga.obs.raymetrics`), which one killed at once
    may lose (a run's last seconds of steps, up to Ray's report interval)."""
    exits = [a.__ray_terminate__.remote() for a in actors]
    if exits:
        # each call ends in the actor's death, an error: its readiness is the wait
        ready, _ = ray.wait(exits, num_returns=len(exits), timeout=timeout_s)
        for ref in ready:
            with contextlib.suppress(Exception):
                ray.get(ref)
