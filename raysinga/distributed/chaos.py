"""Chaos: SIGKILL a distributed run's role processes at seeded random instants.

The harness finds the processes the way an operator would, through Ray's own state (the state
API, :func:`ray.util.state.list_actors`, or where the cluster runs no dashboard, the actor table
of Ray's control store), never through the project's fault hooks: it only asks the run which
actors are its roles now. Kills fall at random instants after the run starts, so some land while
the roles are spawned and loaded; ``in_recovery`` of them are aimed at the next recovery
window instead: they fall the moment the driver starts recovering from the kill before. The
first kill falls at a random instant after the run starts (often while its roles start), each
other one at a random instant after training has gone on again from the kill before.

Use it around :meth:`DistributedTrainer.fit`::

    chaos = Chaos(trainer, seed=7, kills=20)
    with chaos:
        result = trainer.fit()
    print(chaos.report())

``benchmarks/chaos.py`` runs a job under chaos and compares it with an uninterrupted run.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from raysinga.obs.events import Event, Recovered, StateChanged, TrainStep

RECOVERY_STATES = ("recovering", "placing", "launching")
ENDED_STATES = ("finished", "stopped")


@dataclass(frozen=True)
class Kill:
    """One SIGKILL: when (seconds since the harness started), whom, and what the driver was
    doing then (its state, and the furthest step reported)."""

    at_s: float
    role: str
    pid: int
    node: str
    state: str
    step: int
    aimed: str  # "random" or "recovery"


class Chaos:
    """Kills ``kills`` role processes of ``trainer``'s run, one at a time: the first at a
    random instant ``gap_s`` (a uniform range, seconds) after the start, each other one that
    long after training has reported a step since the kill before, except ``in_recovery`` of
    them (chosen by the seed among the second and later), which fall as soon as the driver
    starts recovering from the kill before."""

    def __init__(
        self,
        trainer: Any,
        seed: int,
        kills: int,
        gap_s: tuple[float, float] = (0.5, 2.0),
        in_recovery: int = 1,
        log: Any = None,
        cluster: Any = None,
        node_share: float = 0.0,
    ) -> None:
        """``cluster`` (a ``ray.cluster_utils.Cluster``) and ``node_share``: that share of the
        kills removes the chosen role's whole node instead (its raylet and every process on
        it), then adds a node of the same size, so that the run has room again."""
        if kills < 0 or not 0 <= in_recovery <= max(0, kills - 1):
            raise ValueError(f"chaos: {in_recovery} of {kills} kills cannot be aimed at recoveries")
        self.trainer, self.seed, self.kills, self.gap_s = trainer, seed, kills, gap_s
        self.rng = random.Random(seed)
        self.aimed = set(self.rng.sample(range(1, kills), in_recovery)) if kills > 1 else set()
        self.log = log or (lambda line: None)
        self.cluster, self.node_share = cluster, node_share
        self.done: list[Kill] = []
        self.failures: list[dict[str, Any]] = []
        self.state, self.step = "placing", 0
        self.to_next_step: list[float] = []  # seconds from each kill to the next step reported
        self._awaiting: list[float] = []  # kills not yet followed by a recovery and a step
        self._recovered = False
        self._killed: set[int] = set()
        self._to_add: list[int] = []  # nodes removed, to be replaced (their CPUs)
        self._lock = threading.Lock()
        self._t0 = 0.0
        self._recovering = threading.Event()
        self._going_on = threading.Event()  # a step reported since the last kill's recovery
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._list = _actor_lister()

    # ------------------------------------------------------------------ the run's events
    def _on_event(self, ev: Event) -> None:
        if self._to_add:
            self._add_nodes()
        if isinstance(ev, StateChanged):
            self.state = ev.state
            if ev.state == "recovering":
                self._recovering.set()
            if ev.state in ENDED_STATES:
                self._stop.set()
        elif isinstance(ev, TrainStep):
            self.step = max(self.step, ev.step)
            with self._lock:
                if self._recovered and self._awaiting:
                    now = time.monotonic()
                    self.to_next_step += [now - t for t in self._awaiting]
                    self._awaiting.clear()
                    self._going_on.set()
                self._recovered = False
        elif isinstance(ev, Recovered):
            self.failures.append(ev.record())
            with self._lock:
                self._recovered = True

    def __enter__(self) -> Chaos:
        self.trainer.hub.subscribe(self._on_event, first=True)
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self._thread.start()
        self.log(
            f"chaos: seed {self.seed}, {self.kills} kill(s), {len(self.aimed)} aimed at a recovery"
        )
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ killing
    def _run(self) -> None:
        for n in range(self.kills):
            if n in self.aimed:
                self._recovering.clear()
                # the next recovery: the one from the kill before, unless it is over already
                if not self._wait_for_recovery():
                    return
                aimed = "recovery"
            else:
                if n > 0 and not self._wait(self._going_on):
                    return
                if self._stop.wait(self.rng.uniform(*self.gap_s)):
                    return
                aimed = "random"
            if not self._kill_one(aimed):
                return
            if n + 1 in self.aimed:
                self._recovering.clear()

    def _wait_for_recovery(self, most_s: float = 5.0) -> bool:
        """Wait for a recovery to be under way (at most ``most_s``: the kill before may have
        been absorbed by a recovery already over, and none may come; the kill is then made
        where the run stands, its record saying so); False once the run has ended."""
        deadline = time.monotonic() + most_s
        while not self._stop.is_set():
            if self._recovering.wait(0.05) or self.state in RECOVERY_STATES:
                return True
            if time.monotonic() > deadline:
                return True
        return False

    def _wait(self, event: threading.Event, most_s: float = 30.0) -> bool:
        """Wait for ``event`` (at most ``most_s``: a kill the run never noticed, of a role
        being stopped anyway, is followed by no recovery); False once the run has ended."""
        deadline = time.monotonic() + most_s
        while not self._stop.is_set():
            if event.wait(0.05) or time.monotonic() > deadline:
                return True
        return False

    def _kill_one(self, aimed: str) -> bool:
        """SIGKILL a random live role of the run (waiting while it has none: it is being
        placed); False once the run has ended."""
        while not self._stop.is_set():
            mine = self._role_ids()
            alive = [
                a for a in self._list() if a["actor_id"] in mine and a["pid"] not in self._killed
            ]
            if alive:
                a = self.rng.choice(sorted(alive, key=lambda a: a["actor_id"]))
                state, step = self.state, self.step
                with self._lock:
                    self._awaiting.append(time.monotonic())
                    self._recovered = False
                    self._going_on.clear()
                self._killed.add(a["pid"])
                node = self._node_to_remove(a["node_id"])
                if node is not None:
                    self._remove(node)
                else:
                    sigkill(a["pid"], a["node_id"])
                kill = Kill(
                    round(time.monotonic() - self._t0, 3),
                    "node" if node is not None else a["class_name"],
                    a["pid"],
                    a["node_id"][:8],
                    state,
                    step,
                    aimed,
                )
                self.done.append(kill)
                self.log(
                    f"chaos: kill {len(self.done)}/{self.kills} at {kill.at_s:.2f} s: "
                    f"{kill.role} pid {kill.pid} on node {kill.node} "
                    f"(driver {state}, step {step}, {aimed})"
                )
                return True
            time.sleep(0.02)
        return False

    def _node_to_remove(self, node_id: str) -> Any:
        if self.cluster is None or self.rng.random() >= self.node_share:
            return None
        found = [n for n in self.cluster.worker_nodes if n.node_id == node_id]
        return found[0] if found else None  # never the head

    def _remove(self, node: Any) -> None:
        """Remove ``node``; a node of its size joins from the driver's thread (Ray starts a
        node only from a process's main thread), at the run's next event."""
        cpus = node._ray_params.num_cpus
        self.cluster.remove_node(node)
        with self._lock:
            self._to_add.append(cpus)

    def _add_nodes(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        with self._lock:
            adding, self._to_add = self._to_add, []
        for cpus in adding:
            self.cluster.add_node(num_cpus=cpus)

    def _role_ids(self) -> set[str]:
        t = self.trainer
        try:
            actors = [*t.servers, *(w for row in t.workers for w in row), *t.stubs]
        except (AttributeError, TypeError):  # the roles are being replaced this instant
            return set()
        return {a._actor_id.hex() for a in actors}

    def report(self) -> dict[str, Any]:
        """The seed, every kill, every failure record the run made."""
        return {
            "seed": self.seed,
            "kills": [asdict(k) for k in self.done],
            "failures": list(self.failures),
            "to_next_step_s": list(self.to_next_step),
        }


def _actor_lister() -> Any:
    """Live actors as dicts (actor_id, pid, node_id, class_name): through Ray's state API, or
    where that has no server (a cluster without its dashboard), Ray's control store."""
    import ray  # noqa: PLC0415

    gcs = ray.get_runtime_context().gcs_address

    def state_api() -> list[dict[str, Any]]:
        from ray.util.state import list_actors  # noqa: PLC0415

        rows = list_actors(address=gcs, filters=[("state", "=", "ALIVE")], limit=10_000)
        return [
            {"actor_id": r.actor_id, "pid": r.pid, "node_id": r.node_id, "class_name": r.class_name}
            for r in rows
        ]

    def control_store() -> list[dict[str, Any]]:
        from ray._private import state  # noqa: PLC0415

        return [
            {
                "actor_id": a["ActorID"],
                "pid": a["Pid"],
                "node_id": a["Address"]["NodeID"],
                "class_name": a["ActorClassName"],
            }
            for a in state.actors().values()
            if a["State"] == "ALIVE"
        ]

    try:
        state_api()
        return state_api
    except Exception:  # noqa: BLE001 - no state API server here
        return control_store


def sigkill(pid: int, node_id: str) -> None:
    """SIGKILL ``pid`` on its node: here directly, elsewhere by a task placed on that node."""
    import ray  # noqa: PLC0415
    from ray.util.scheduling_strategies import (  # noqa: PLC0415
        NodeAffinitySchedulingStrategy,
    )

    if node_id == ray.get_runtime_context().get_node_id():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    task = ray.remote(_kill_here).options(num_cpus=0, scheduling_strategy=strategy)
    try:
        ray.get(task.remote(pid), timeout=30)
    except ray.exceptions.RayError:
        pass  # the node went meanwhile: so did the process


def _kill_here(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
