"""The distributed trainer: servers, worker groups and stubs as Ray actors, driven from here.

The driver never touches parameters or gradients: servers create and update them, workers read
them in place, stubs sum gradients. :class:`DistributedTrainer` checks the job and its data,
opens the run's session (lock, start decision, signals, commit bookkeeping) and hands the run to
the :class:`~raysinga.distributed.controller.Controller`, whose states place, launch, run,
checkpoint, recover and resize.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from raysinga.actors.common.slicing import plan_slices
from raysinga.actors.server import ParamServer
from raysinga.actors.stub import Stub
from raysinga.actors.worker import Worker
from raysinga.cluster import ray_messages, reach, shipping
from raysinga.cluster.connect import connect, joins_cluster, unreachable_nodes
from raysinga.config.job import JobConfig
from raysinga.data import identity as data_identity
from raysinga.kernels import precision
from raysinga.nn.model import Net
from raysinga.obs.console import hub_for
from raysinga.obs.events import Subscriber
from raysinga.obs.metrics import TrainResult
from raysinga.obs.raymetrics import RunMetrics
from raysinga.optim.optimizers import make_optimizer
from raysinga.run.divergence import Diverged, chance_loss
from raysinga.run.session import RunSession, check_start_options
from raysinga.run.trainer import open_data

from .controller import Controller
from .failures import FailuresExceeded
from .role_group import RunPlan
from .status import RunStatus

ROLE_CLASSES = {"server": ParamServer, "worker": Worker, "stub": Stub}

__all__ = ["DistributedTrainer", "FailuresExceeded"]


class DistributedTrainer:
    """Runs a :class:`JobConfig` on a Ray cluster with the config's topology."""

    def __init__(
        self,
        cfg: JobConfig,
        log: Callable[[str], None] | None = print,
        classes: dict[str, type] | None = None,
        address: str | None = None,
        resume: bool | str = False,
        init_from: str | None = None,
        fresh: bool = False,
        gather: bool = True,
        on_event: Subscriber | Iterable[Subscriber] | None = None,
        ship: bool = True,
        fork_from: Any = None,
    ) -> None:
        """``resume``: True continues the newest valid checkpoint of the run (an error if there
        is none), ``"auto"`` continues one if there is one; ``init_from``: a checkpoint whose
        parameters start a new run, matched by name; ``fresh``: delete the run's checkpoints
        first; ``gather``: return the final parameters in the result (small models). ``log``
        gets the run's events as console lines, ``on_event`` the events themselves
        (:mod:`raysinga.obs.events`); more subscribers can join :attr:`hub` before :meth:`fit`.
        ``ship``: on a cluster joined, hand raysinga's code to the roles
        (:mod:`raysinga.cluster.shipping`); off where every node has raysinga installed.
        ``fork_from``: a checkpoint (a path or URI, or an object-store ref) of another run whose
        whole state this run goes on from, under this job's optimizer hyperparameters, as
        :class:`~raysinga.run.trainer.Trainer` does."""
        check_start_options(resume, init_from, fresh, fork_from)
        self.cfg, self.address, self.gather, self.ship = cfg, address, gather, ship
        self.resume, self.init_from, self.fresh = resume, init_from, fresh
        self.fork_from = fork_from
        # names the run's placement group, whose earlier copy a start removes (placement.place):
        # set by callers that may be stopped without a chance to free it (raysinga.tune)
        self.placement_name = ""
        self.hub = hub_for(log, on_event)
        self.classes = {**ROLE_CLASSES, **(classes or {})}
        topo = cfg.topology
        self.net = Net(cfg.model, dtype=cfg.dtype)
        train = open_data(cfg, self.net, self.hub.notice).train  # the workers load their own
        self.data = data_identity.identity(train, cfg.data.batch_size, cfg.data.shuffle)
        if cfg.data.batch_size < topo.workers_per_group:
            raise ValueError(
                f"data.batch_size {cfg.data.batch_size} is smaller than "
                f"topology.workers_per_group {topo.workers_per_group}"
            )
        shapes = self.net.param_shapes()
        updater = cfg.optimizer
        worker_device, server_device = role_devices(cfg)
        note = precision.emulation_note(cfg.precision.compute, worker_device)
        if note:
            self.hub.notice(note)
        self.plan = RunPlan(
            shapes=shapes,
            slices=plan_slices(shapes, self.net.dtype.itemsize, topo.n_servers, topo.slice_bytes),
            updater=updater,
            schedule=make_optimizer(updater).schedule,  # for the lr in progress reports
            worker_device=worker_device,
            server_device=server_device,
            state_names=list(self.net.state_shapes()),
            n_train=len(train),
            run_dir=Path(cfg.run_path),
            chance_loss=chance_loss(cfg.model.loss, self.net.output_shape),
        )
        self.session: RunSession | None = None
        self.controller: Controller | None = None

    def fit(self) -> TrainResult:
        import ray  # noqa: PLC0415

        started = ray.is_initialized()  # by other code: the roles get the modules alone
        joins = joins_cluster(self.address) and not started
        # raysinga's code where the run joins a cluster, and the job's own modules (its
        # layers), where it ships: the roles of an embedded Ray do not see this process's path
        env = shipping.runtime_env(self.cfg.modules, own=joins) if self.ship else None
        line = connect(self.address, None if started else env)
        if started and self.ship:
            self.plan = dataclasses.replace(self.plan, role_env=shipping.role_env(self.cfg.modules))
        self.hub.notice(line)
        # machines gone or cut off that Ray still counts alive: no role goes there
        unreachable = unreachable_nodes() if len(ray.nodes()) > 1 else {}
        for node, address in unreachable.items():
            self.hub.notice(
                f"raysinga: node {address} ({node[:8]}) does not answer; no role is placed there"
            )
        skip = frozenset(unreachable)
        self.unreachable = unreachable
        if joins or self.cfg.modules:  # before any role: one line for a node that cannot
            shipping.check_nodes(skip=skip, modules=self.cfg.modules, env=self.plan.role_env)
        cfg = self.cfg
        # before anything of the run is written: storage and data every node sees
        reach.check(cfg.checkpoint_dir, reach.local_data_files(cfg.data.source), skip)
        self.session = RunSession(
            cfg,
            self.plan.shapes,
            self.net.dtype,
            self.data,
            self.hub,
            self.resume,
            self.init_from,
            self.fresh,
            self.fork_from,
        )
        seen = RunMetrics(cfg.name, self._spares_ready) if cfg.metrics.ray else None
        status = RunStatus(cfg.name, Path(cfg.run_path), self._roles, self._spares)
        removes = [self.hub.subscribe(status, first=True)]
        if seen:
            removes.append(self.hub.subscribe(seen))
        try:
            with ray_messages.kept_in(Path(cfg.run_path)):
                return self._fit(seen)
        finally:
            for remove in removes:
                remove()
            if seen:
                seen.ended()

    def _roles(self) -> Any:
        return self.controller.roles if self.controller else None

    def _spares(self) -> list[dict[str, Any]]:
        replacer = self.controller.replacer if self.controller else None
        return replacer.spares.listed() if replacer else []

    def _spares_ready(self) -> int:
        replacer = self.controller.replacer if self.controller else None
        return replacer.spares.ready_count() if replacer else 0

    def _fit(self, seen: RunMetrics | None) -> TrainResult:
        cfg = self.cfg
        with self.session, self.session.stop_signals():
            self.controller = Controller(
                cfg,
                self.plan,
                self.session,
                self.hub,
                self.classes,
                self.gather,
                self.placement_name,
            )
            self.controller.watch.unreachable.update(self.unreachable)  # placed nowhere
            try:
                return self.session.finish(self.controller.run())
            except Diverged:
                if seen:
                    seen.diverged()
                raise

    # What tests and tools look at while a run goes on, or after it.
    @property
    def topo(self) -> Any:
        return self.controller.topo if self.controller else self.cfg.topology

    @property
    def worker_device(self) -> str:
        return self.plan.worker_device

    @property
    def server_device(self) -> str:
        return self.plan.server_device

    @property
    def servers(self) -> list[Any]:
        roles = self.controller.roles if self.controller else None
        return roles.servers if roles else []

    @property
    def workers(self) -> list[list[Any]]:
        roles = self.controller.roles if self.controller else None
        return roles.workers if roles else []

    @property
    def stubs(self) -> list[Any]:
        roles = self.controller.roles if self.controller else None
        return roles.stubs if roles else []

    @property
    def tag(self) -> str:
        """Names the shared-memory files of the roles spawned last."""
        return self.controller.tag if self.controller else ""

    @property
    def failures(self) -> list[dict[str, Any]]:
        return self.controller.book.failures if self.controller else []

    @property
    def saved(self) -> list[dict[str, Any]]:
        return self.session.saved if self.session else []


def role_devices(cfg: JobConfig) -> tuple[str, str]:
    """Where workers and servers compute: workers given GPUs compute on them, servers given GPUs
    run their optimizer there. The job's ``device`` decides, or where it is ``auto``, the
    driver's ``RAYSINGA_DEVICE`` (the roles do not inherit the driver's environment): ``cpu``
    keeps every role on the CPU whatever its resources; ``gpu`` requires workers with GPUs."""
    want = cfg.device
    if want == "auto":
        want = os.environ.get("RAYSINGA_DEVICE", "").strip().lower() or "auto"
        if want not in ("auto", "cpu", "gpu"):
            raise ValueError(f"RAYSINGA_DEVICE must be 'cpu', 'gpu' or 'auto', got {want!r}")
        if want == "gpu" and not cfg.topology.worker.gpus:
            raise ValueError(
                "RAYSINGA_DEVICE=gpu in a distributed run needs GPUs for the workers: set "
                "topology.worker.gpus (e.g. --set topology.worker.gpus=0.5 to put two workers "
                "on one GPU), or train in one process with --local"
            )
    topo = cfg.topology
    return (
        "gpu" if topo.worker.gpus and want != "cpu" else "cpu",
        "gpu" if topo.server.gpus and want != "cpu" else "cpu",
    )
