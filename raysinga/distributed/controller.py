"""The distributed controller: a state machine whose states decide and whose loop executes.

::

    PLACING --> LAUNCHING --> RUNNING <--> CHECKPOINTING --> FINISHED
       ^                        ^          |      |
       |                        |          |      +--> STOPPED (a stop signal)
       +---------- RESIZING <---+----------+  (room to grow)
       |                        | (a worker or stub replaced alone)
       +---------- RECOVERING <-+-- a role lost in any state but the last three

- **placing**: reserve the topology (the largest that fits, for an elastic run).
- **launching**: spawn the servers, verify and load the start checkpoint (the newest committed
  one after a loss or a resize), spawn the workers and the stubs.
- **running**: the groups run chunks of steps until every group stands at a step boundary.
- **checkpointing**: begin a checkpoint of that boundary (the servers write it in the
  background), or at the end or on a stop finish it; then run on, resize, finish or stop.
- **recovering**: count the loss against ``fault.max_failures``. A lost worker or stub is
  replaced alone, and a synchronous group's lost server rebuilt
  (:mod:`raysinga.distributed.replace`), and the run goes on running (other asynchronous
  groups' chunks never stopped);
  otherwise stop every role, abandon a checkpoint in flight, and place again from the newest
  committed checkpoint.
- **resizing**: stop every role at a committed boundary and place the larger topology.

Each transition goes through :meth:`Controller._enter`, which emits a
:class:`~raysinga.obs.events.StateChanged` event.
"""

from __future__ import annotations

import contextlib
import enum
import time
from typing import Any

from ray.exceptions import ObjectLostError
from ray.util.placement_group import remove_placement_group

from raysinga.actors import placement
from raysinga.actors.common.errors import ActorLost
from raysinga.obs.events import EventHub, RunStarted, StateChanged
from raysinga.obs.metrics import TrainResult, recording
from raysinga.run.session import RunSession

from .coordinator import CheckpointCoordinator
from .elastic import Elastic
from .failures import FailureBook, first_line
from .rebuild_async import rebuild_async
from .replace import ReplaceFailed, Replacer, grad_nbytes, replay_steps
from .role_group import RoleGroup
from .silence import Silent, Watch
from .spares import live_nodes
from .stepping import StepRunner


class State(enum.Enum):
    PLACING = "placing"
    LAUNCHING = "launching"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    RECOVERING = "recovering"
    RESIZING = "resizing"
    FINISHED = "finished"
    STOPPED = "stopped"


LOSSES = (ActorLost, ObjectLostError)  # a role, its node or an object it held is gone
REPLACE_S = 20.0  # how long a replacement may wait for a role to answer


class Controller:
    """Runs one distributed training run to its end, through the states above."""

    def __init__(
        self,
        cfg: Any,
        plan: Any,
        session: RunSession,
        hub: EventHub,
        classes: dict[str, type],
        gather: bool,
        placement_name: str = "",
    ) -> None:
        self.cfg, self.plan, self.session, self.hub = cfg, plan, session, hub
        self.classes, self.gather = classes, gather
        self.elastic = Elastic(cfg.topology, cfg.fault, hub.notice, placement_name)
        self.coordinator = CheckpointCoordinator(session)
        self.topo = cfg.topology  # as running (an elastic run may run a smaller one)
        self.placement: placement.Placement | None = None
        self.roles: RoleGroup | None = None
        self.replacer: Replacer | None = None  # replaces a lost worker or stub of the roles
        self.steps: StepRunner | None = None
        self.result = TrainResult({}, {}, [])
        self.progress = 0  # the most steps a group has done (as far as the driver knows)
        self.restart = False  # the next launch starts from the newest committed checkpoint
        self.book = FailureBook(cfg.fault, session.root, hub, cfg.lr_scale)
        self.lost: BaseException | None = None  # the loss being recovered from
        self.cursor: Any = None  # the data cursor of the running launch
        self.grow = False  # the cluster has room for more workers or groups than are running
        self.t_grow = self.t_ckpt = time.perf_counter()
        self._recording = contextlib.ExitStack()
        self.tag = ""  # names the shared-memory files of the roles spawned last
        self.watch = Watch(cfg.fault)  # the heartbeat to the roles while groups run
        self.epoch = 0  # raised at every launch and recovery: older roles are fenced off
        self.elastic.avoid = self.watch.unreachable  # one record of the nodes to avoid
        self.state = State.PLACING
        self.handlers = {
            State.PLACING: self._placing,
            State.LAUNCHING: self._launching,
            State.RUNNING: self._running,
            State.CHECKPOINTING: self._checkpointing,
            State.RECOVERING: self._recovering,
            State.RESIZING: self._resizing,
        }

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainResult:
        """From placing to finished. A lost role in any state leads to recovering; a stop
        signal ends in stopped (:class:`~raysinga.run.session.Preempted` is raised)."""
        try:
            self._enter(State.PLACING)
            while self.state not in (State.FINISHED, State.STOPPED):
                try:
                    self._enter(self.handlers[self.state]())
                except LOSSES as e:
                    self.lost = e
                    self._enter(State.RECOVERING)
            if self.state is State.STOPPED:
                raise self.session.preempted(self.progress)
            return self.result
        finally:
            self._teardown(graceful=True)

    def _enter(self, state: State) -> None:
        self.state = state
        self.hub.emit(StateChanged(state.value, self.progress))

    def _teardown(self, graceful: bool) -> None:
        """Stop every role and free the placement; a checkpoint in flight is never committed."""
        self._recording.close()
        if self.steps is not None:
            self.progress = self.steps.progress
        if self.roles is not None:
            calls = [*self.steps.chunks, *self.steps.abandoned] if self.steps is not None else []
            self.tag = self.roles.tag
            self.roles.shutdown(graceful, calls)
        elif self.placement is not None:
            remove_placement_group(self.placement.pg)
        self.roles = self.steps = self.placement = self.replacer = None
        self.coordinator.abandon()

    # ------------------------------------------------------------------ the states
    def _placing(self) -> State:
        self.topo, self.placement = self.elastic.place()
        return State.LAUNCHING

    def _launching(self) -> State:
        session, cfg = self.session, self.cfg
        start = session.newest() if self.restart else session.start
        assert self.placement is not None
        roles = self.roles = RoleGroup(cfg, self.classes, self.topo, self.placement, self.plan)
        self.tag = roles.tag
        self.placement = None  # the role group frees it from now on
        roles.spawn_servers(start.seed)
        if start.source is not None:  # a resume falls back past a corrupt checkpoint here
            start = session.verify(roles.verify)
        roles.spawn_workers(start.seed)
        roles.describe()
        steps0, cursor = start.position(self.topo.n_groups)
        if start.info is not None and len(start.info["steps"]) != self.topo.n_groups:
            session.log(
                f"raysinga: {len(start.info['steps'])} group(s) saved, {self.topo.n_groups} "
                f"now: all start at step {steps0[0]}, skipping the batches the faster groups "
                "had taken"
            )
        self.progress = max(steps0)
        if start.source is not None:  # before the servers first publish their values
            t0 = time.perf_counter()
            roles.restore(start, cursor, self.plan.state_names)
            dt = time.perf_counter() - t0
            session.log(f"raysinga: loaded {start.source.label} in {dt:.2f} s")
        periodic = bool(cfg.checkpoint_frequency or cfg.checkpoint_every_seconds)
        replaceable = self._replaceable()
        # summed by hosts, no role holds a step's whole sum to log: a lost server restarts
        rebuildable = replaceable and self.topo.reduce == "stub"
        roles.replay = replay_steps(cfg.fault, self.plan.shapes, cfg.dtype) if rebuildable else 0
        roles.wire(prepare_snapshots=periodic and cfg.checkpoint.compression is None)
        roles.keep_copies()
        if roles.replay and not self.restart:
            mib = roles.replay * grad_nbytes(self.plan.shapes, cfg.dtype) / 2**20
            self.hub.notice(
                f"raysinga: a lost server is rebuilt from copies taken every "
                f"{roles.replay // 2} steps and a log of {roles.replay} steps ({mib:.1f} MiB)"
            )
        self.replacer = Replacer(roles, spares=cfg.fault.spares) if replaceable else None
        if self.replacer is not None:
            self.replacer.avoid = self.watch.unreachable
        self._fence()
        source = start.source.label if start.source is not None else "the start"
        self.book.relaunched(source, self.progress, self.topo)
        self._begin_steps(start, steps0, cursor)
        return State.RUNNING

    def _begin_steps(self, start: Any, steps0: list[int], cursor: Any) -> None:
        """The loop of this launch: its history (the start's, then every failure and resize
        so far) and its metrics files."""
        seen = {(r["kind"], r["time"]) for r in start.history(max(steps0)) if "time" in r}
        history = start.history(max(steps0))
        history += [r for r in self.book.notes if (r["kind"], r["time"]) not in seen]
        self.result = TrainResult({}, {}, history)
        self.cursor = cursor
        self.steps = StepRunner(self.cfg, self.topo, self.plan, self.hub, steps0, history)
        self.steps.watch = self.watch
        self.session.guard = self.steps.guard
        self._recording.enter_context(
            recording(self.hub, self.plan.run_dir, self.result, self.cfg.tensorboard)
        )
        t, cfg = self.topo, self.cfg
        self.hub.emit(
            RunStarted(
                cfg.name,
                f"Ray: {t.preset}, {t.n_servers} server(s), {t.n_groups} group(s) x "
                f"{t.workers_per_group} worker(s), {len(self.plan.slices)} slices, "
                f"{cfg.train_steps} steps per group, batch {cfg.data.batch_size}",
                cfg.train_steps,
                max(steps0),
            )
        )
        self.t_grow = self.t_ckpt = time.perf_counter()

    def _running(self) -> State:
        assert self.steps is not None
        self.steps.run(self.roles, self._hold)
        self.progress = self.steps.progress
        return State.CHECKPOINTING

    def _hold(self) -> bool:
        """Between chunks: commit a checkpoint whose shards are written, and say whether to
        stop at the next step boundary (a stop signal, a checkpoint due by time, room to grow)."""
        assert self.steps is not None and self.roles is not None
        self.progress = self.steps.progress
        if self.replacer is not None:  # once training runs again, not to delay its first step
            self.replacer.prepare()
        self.coordinator.finish(self.roles, wait=False)
        now, cfg = time.perf_counter(), self.cfg
        every = cfg.checkpoint_every_seconds
        hold = self.session.stop_signal is not None or bool(every and now - self.t_ckpt >= every)
        if self.topo != self.elastic.full and now - self.t_grow >= cfg.fault.grow_check_s:
            self.t_grow = now
            self.grow = self.elastic.room_to_grow(self.topo)
        return hold or self.grow

    def _checkpointing(self) -> State:
        steps, roles, co = self.steps, self.roles, self.coordinator
        assert steps is not None and roles is not None
        done, history = steps.done, self.result.history
        if self.session.stop_signal is not None or steps.finished:
            if self.cfg.checkpoint.final:
                co.begin(roles, done, self.cursor, history)
            co.finish(roles, wait=True)
            if not steps.finished:
                return State.STOPPED
            if self.gather:
                self.result.params = roles.gather_params()
                self.result.state = roles.gather_state()
            return State.FINISHED
        co.begin(roles, done, self.cursor, history)
        if self.grow:
            co.finish(roles, wait=True)
            return State.RESIZING
        steps.passed_boundary()
        self.t_ckpt = time.perf_counter()
        return State.RUNNING

    def _recovering(self) -> State:
        """Count the loss (more than ``fault.max_failures`` within ``fault.window_s`` stop the
        run with a summary of all of them). A lost worker or stub is replaced in place where
        it can be, and its group redoes the interrupted step; otherwise every role is stopped
        and the next launch starts from the newest committed checkpoint."""
        t0 = time.perf_counter()
        if self.steps is not None:
            self.progress = self.steps.progress
        if self.roles is not None:  # the watch names the roles as they were: lost ones too
            self.roles.watch = None  # (until the roles are fenced again)
        if isinstance(self.lost, Silent):
            line = self.watch.taken_lost(self.lost)
            if line:
                self.hub.notice(line)
        running = self.steps.interrupted if self.steps is not None else None
        chunk = running[1:] if running is not None else None  # (group, start, end) -> its steps
        rec = self.book.count(self.lost, self.progress, chunk)
        if self._replace(rec, t0):
            return State.RUNNING
        lost = self.roles.actors if self.roles is not None else []
        self.book.restarting_from(rec, t0, lost, self.topo)
        self._teardown(graceful=False)
        self.restart = True
        return State.PLACING

    def _replaceable(self) -> bool:
        """Whether a lost worker or stub of this run can be replaced alone (and, in a
        synchronous run (one group) with ``fault.replay_steps``, a lost server rebuilt):
        ``fault.recovery: replace``, on the CPU and on GPUs alike (a worker with state of its
        own copies it after every step)."""
        return self.cfg.fault.recovery == "replace"

    def _replace(self, rec: dict[str, Any], t0: float) -> bool:
        """Replace a lost worker or stub alone, or rebuild a lost server from its copy and
        the stub's log: the other roles keep their state, so nothing is rolled back and the
        group redoes at most the step it was interrupted in."""
        e, roles, steps = self.lost, self.roles, self.steps
        if not (
            self._replaceable()
            and isinstance(e, ActorLost)
            and roles is not None
            and (e.role in ("worker", "stub") or (e.role == "server" and roles.replay > 0))
            and steps is not None
            and self.replacer is not None
        ):
            return False
        if e.role == "server" and self.topo.n_groups > 1:
            return self._rebuild_async(rec, t0)
        g = e.group if e.group is not None else 0  # a server's: the synchronous group's
        if not 0 <= g < self.topo.n_groups:
            return False
        lost = roles.actors
        try:
            done = self.replacer.replace(g, self.cursor, steps.done[g])
        except (*LOSSES, ReplaceFailed) as why:  # another role went too, or (said) no room ...
            what = first_line(why)
            what = what if isinstance(why, ReplaceFailed) else f"another role was lost: {what}"
            rec["not_replaced"] = what
            self.hub.notice(f"raysinga: not replaced alone ({what}); restarting every role")
            return False
        # The other groups ran on meanwhile; their steps under way end before the new epoch is
        # told (a server would refuse an update their stub sent just before, as from a role
        # replaced since)
        if self.topo.n_groups > 1 and not steps.drain(REPLACE_S):
            return False
        self._go_on(rec, t0, lost, done, {g: done.at})
        return True

    def _rebuild_async(self, rec: dict[str, Any], t0: float) -> bool:
        """A lost server of asynchronous groups: every group's chunk under way ends first (each
        group's steps reach every server), then the server is rebuilt from its copy and every
        group's log in the order it applied them, and each group goes on from the first of its
        steps some server has not applied."""
        roles, steps = self.roles, self.steps
        assert roles is not None and steps is not None and self.replacer is not None
        lost = roles.actors
        if not steps.drain(REPLACE_S):
            return False
        try:
            done = rebuild_async(self.replacer, list(steps.done), REPLACE_S)
        except (*LOSSES, ReplaceFailed):
            done = None
        if done is None or done.positions is None:
            return False
        self._go_on(rec, t0, lost, done, done.positions)
        return True

    def _go_on(
        self, rec: dict[str, Any], t0: float, lost: list, done: Any, at: dict[int, int]
    ) -> None:
        """After a role replaced alone (``done``): a checkpoint its lost server never wrote
        is dropped, each group goes on from its step in ``at`` (the interrupted one again),
        the roles learn the new epoch, and the replacement is booked."""
        roles, steps = self.roles, self.steps
        assert roles is not None and steps is not None
        self.coordinator.drop_if_lost(roles, done.rebuilt)
        redone = 1 if steps.interrupted is not None else 0
        steps.interrupted = None
        for g, step in at.items():
            steps.done[g] = step
        self.progress = steps.progress
        self._fence()
        self.book.replaced(rec, t0, lost, done, redone, self.topo)

    def _fence(self) -> None:
        """A new epoch, told to every role before training goes on (a role replaced while cut
        off is refused from now on, :mod:`raysinga.actors.exchange.fence`), and the heartbeat to the
        roles as they now are. Nodes Ray has since marked dead need no avoiding."""
        assert self.roles is not None
        self.epoch += 1
        self.roles.fence(self.epoch)
        self.watch.arm(self.roles.watched())
        self.watch.forget_gone(live_nodes())
        # the checkpoints' calls to the roles wait listening to them too
        self.roles.watch, self.roles.notice = self.watch, self.hub.notice

    def _resizing(self) -> State:
        """At a step boundary with a committed checkpoint of it: stop every role and place
        the largest topology the cluster now holds."""
        self.book.resizing(self.progress, self.topo)
        self._teardown(graceful=True)
        self.restart, self.grow = True, False
        return State.PLACING
