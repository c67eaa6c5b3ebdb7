"""raysinga's metrics where a Ray cluster's operators look: recorded through
``ray.util.metrics`` by the process that knows them, and exported by its node's metrics agent,
as Ray's own are (Prometheus format, read by Ray's dashboard and by Grafana). raysinga runs no
exporter of its own.

Each role records what it measures itself: a worker its reads of the values and its forward
and backward, a server its updates and checkpoint writes, a stub its group's steps, their
phases and the bytes they moved between hosts; each, from its first step, that its process
lives (``role_up``). The driver records the run's: loss, samples/s, checkpoints committed,
recoveries, spares ready and the divergence guard's stops. Every series is tagged by ``run``
(the job's name), ``role`` (``worker``, ``server``, ``stub``, ``driver``), ``index`` and
``group`` (empty where they do not apply), and the tags of its own below. Off with
``metrics.ray: false``. Ray prefixes the names: ``ray_raysinga_steps_total``.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import Any

from .events import CheckpointCommitted, Event, Recovered, RunStarted, TrainStep

PREFIX = "raysinga_"
UP_EVERY_S = 1.0  # how often a role sets role_up again (Ray's shortest report interval)
BASE_TAGS = ("run", "role", "index", "group")
# Seconds: a step's phase, an update, a checkpoint write, a recovery. The phases of a small
# model's step spread from 10 us (a worker's fetch, a stub's average) to tens of ms, a large
# model's compute to seconds, a checkpoint or a recovery to minutes: 1-2-5 steps from 10 us to
# 20 s (each bound at most 2.5 times the one below, so that a phase's median and its 95th
# percentile fall in buckets of their own), then 1 and 5 minutes. Ray's agent counts each
# observation at its bucket's middle (docs/observe.md: what a mean from these is worth).
SECONDS = [1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2]
SECONDS += [0.5, 1, 2, 5, 10, 20, 60, 300]

# name -> (kind, description, tags of its own)
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "steps": ("counter", "training steps taken (a worker's, a group's, the run's)", ()),
    "loss": ("gauge", "the training loss, the mean of the last report's steps", ()),
    "samples_per_second": ("gauge", "samples trained per second over the last report", ()),
    "phase_seconds": (
        "histogram",
        "a step's phases: fetch, compute, gather, average, update (a group's, by its stub); "
        "a worker's fetch and compute; a server's update",
        ("phase",),
    ),
    "wire_bytes": (
        "counter",
        "bytes a group's steps moved from one host to another, as its roles counted them",
        ("host", "peer"),
    ),
    "checkpoint_seconds": (
        "histogram",
        "a checkpoint: a server's write of its shard, or the run's from start to commit",
        (),
    ),
    "checkpoint_bytes": ("counter", "bytes of checkpoint shards a role wrote", ()),
    "checkpoints": ("counter", "checkpoints committed", ()),
    "recoveries": ("counter", "recoveries from a lost role or node, by how", ("kind", "lost")),
    "recovery_seconds": ("histogram", "how long a recovery took, by how", ("kind",)),
    "spares_ready": ("gauge", "spare roles loaded and ready to replace a lost one", ()),
    "divergence_events": ("counter", "the divergence guard's stops of the run", ("level",)),
    "role_up": (
        "gauge",
        "1 while a role's process steps (from its first step), 0 as it ends with the run; "
        "gone once its process has ended",
        (),
    ),
}

_made: dict[str, Any] = {}
_lock = threading.Lock()


def _metric(name: str) -> Any:
    """The process's ``ray.util.metrics`` object of ``name`` (made once per process)."""
    with _lock:
        if name not in _made:
            from ray.util import metrics  # noqa: PLC0415 - only where a run records them

            kind, doc, own = METRICS[name]
            tags = (*BASE_TAGS, *own)
            if kind == "counter":
                _made[name] = metrics.Counter(PREFIX + name, doc, tag_keys=tags)
            elif kind == "gauge":
                _made[name] = metrics.Gauge(PREFIX + name, doc, tag_keys=tags)
            else:
                _made[name] = metrics.Histogram(PREFIX + name, doc, SECONDS, tag_keys=tags)
        return _made[name]


class Recorder:
    """One process's recorder, for one role of one run: ``Recorder(None)`` records nothing
    (``metrics.ray: false``, or no Ray). Tag values are strings; None is recorded as ``""``."""

    def __init__(
        self,
        run: str | None,
        role: str = "driver",
        index: int | None = None,
        group: int | None = None,
    ) -> None:
        self.on = run is not None
        self.up = False  # role_up exported (from this role's first step)
        self._ended, self._up_lock = threading.Event(), threading.Lock()
        self._pending: list[tuple[dict[str, float], dict[str, Any]]] = []  # see later()
        self.tags = {
            "run": run or "",
            "role": role,
            "index": "" if index is None else str(index),
            "group": "" if group is None else str(group),
        }

    def _tags(self, own: dict[str, Any]) -> dict[str, str]:
        return {**self.tags, **{k: "" if v is None else str(v) for k, v in own.items()}}

    def inc(self, name: str, value: float = 1.0, **tags: Any) -> None:
        if self.on and value > 0:
            _metric(name).inc(float(value), tags=self._tags(tags))

    def set(self, name: str, value: float, **tags: Any) -> None:
        if self.on:
            _metric(name).set(float(value), tags=self._tags(tags))

    def observe(self, name: str, value: float, **tags: Any) -> None:
        if self.on:
            _metric(name).observe(float(value), tags=self._tags(tags))

    def zero(self, name: str, **tags: Any) -> None:
        """Counter ``name``'s series exported at 0 before its first event, as Prometheus users
        expect of a series that may appear (a run that never diverged shows 0, not no data)."""
        if self.on:
            # Counter.inc refuses 0; the record under it takes 0 and the agent exports it
            _metric(name)._record(0.0, tags=self._tags(tags))

    def adopt(self, index: int) -> None:
        """A spare takes the place of the role ``index`` of its kind: its series from now on."""
        self.tags["index"] = str(index)

    def stepping(self) -> None:
        """This role steps: ``role_up`` 1 from now on while its process lives, and 0 as it
        exits with the run (a graceful exit hands the agent that value). Of a process
        SIGKILLed or gone, the agent drops the series after two report intervals."""
        if self.on and not self.up:
            self.up = True
            threading.Thread(target=self._renew_up, name="raysinga-role-up", daemon=True).start()
            atexit.register(self.ended)

    def _renew_up(self) -> None:
        # A process hands its agent only the gauges it set since its last report, and the agent
        # drops one not handed for two reports: set again every second while the process lives.
        while True:
            with self._up_lock:
                if self._ended.is_set():
                    return
                self.set("role_up", 1)
            self._ended.wait(UP_EVERY_S)

    def ended(self) -> None:
        """This role's process ends (with the run): ``role_up`` 0, the last value it hands its
        agent. Called as the process exits."""
        with self._up_lock:
            if self.up and not self._ended.is_set():
                self._ended.set()
                self.set("role_up", 0)

    def step(self, phases: dict[str, float], **tags: Any) -> None:
        """One step of this role: the seconds of each of its ``phases``, and the step counted."""
        if self.on:
            self.stepping()
            for phase, seconds in phases.items():
                self.observe("phase_seconds", seconds, phase=phase, **tags)
            self.inc("steps", **tags)

    def later(self, phases: dict[str, float], **tags: Any) -> None:
        """:meth:`step`, recorded at the next :meth:`flush`: a role that steps on doorbells
        records its step once it has rung it done, while it waits for the next, and not
        between the step's work and its ring (each record takes tens of microseconds of
        Ray's tag handling, which the peers waiting on the ring would wait for too)."""
        if self.on:
            self._pending.append((phases, tags))

    def flush(self) -> None:
        """Record what :meth:`later` kept, in the order it came."""
        while True:
            try:  # a role's call threads may flush at once: each record is taken once
                phases, tags = self._pending.pop(0)
            except IndexError:
                return
            self.step(phases, **tags)

    def steps(self, records: Any, address: Callable[[str], str]) -> None:
        """A group's steps (a stub's :class:`~raysinga.actors.common.protocol.StepStats`): each
        one's phases, and the bytes it moved by route (nodes named by ``address``)."""
        if self.on:
            self.stepping()
            for r in records:
                for phase in ("fetch", "compute", "gather", "average", "update"):
                    self.observe("phase_seconds", getattr(r, phase), phase=phase)
                for a, b, n in r.traffic:
                    self.inc("wire_bytes", n, host=address(a), peer=address(b))
            self.inc("steps", len(records))

    def checkpoint(self, seconds: float, nbytes: int) -> None:
        """A checkpoint this role wrote: how long it took, and its size."""
        self.observe("checkpoint_seconds", seconds)
        self.inc("checkpoint_bytes", nbytes)


class RunMetrics:
    """The driver's subscriber (:class:`~.events.EventHub`): the run's metrics from its events.
    ``spares``: how many spare roles stand ready (asked at each report), where the run keeps
    them."""

    def __init__(self, run: str, spares: Callable[[], int] | None = None) -> None:
        self.rec = Recorder(run, "driver")
        self.spares = spares
        self.last_step = 0

    def __call__(self, ev: Event) -> None:
        rec = self.rec
        if isinstance(ev, TrainStep):
            rec.set("loss", ev.loss)
            rec.set("samples_per_second", ev.samples_per_s)
            rec.inc("steps", max(ev.step - self.last_step, 0))
            self.last_step = ev.step
            if self.spares is not None:
                rec.set("spares_ready", self.spares())
        elif isinstance(ev, RunStarted):
            self.last_step = ev.step
            rec.zero("divergence_events", level="diverged")
        elif isinstance(ev, CheckpointCommitted):
            rec.inc("checkpoints")
            rec.observe("checkpoint_seconds", ev.seconds)
        elif isinstance(ev, Recovered):
            info = ev.info
            kind = str(info.get("recovery", "recovered"))
            rec.inc("recoveries", kind=kind, lost=info.get("role", ""))
            seconds = sum(float(info.get(k) or 0.0) for k in ("detection_s", "restore_s"))
            rec.observe("recovery_seconds", seconds, kind=kind)

    def diverged(self) -> None:
        """The guard stopped the run."""
        self.rec.inc("divergence_events", level="diverged")

    def ended(self) -> None:
        """The run ended, however: its spares ended with it."""
        if self.spares is not None:
            self.rec.set("spares_ready", 0)
