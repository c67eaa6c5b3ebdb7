"""The failures of a distributed run: counted against ``fault.max_failures``, and recorded with
what each cost.

A loss is counted when it is detected (:meth:`FailureBook.count`). Its record is completed once
the run goes on: at once when the lost role was replaced in place (:meth:`FailureBook.replaced`),
or after the next successful launch when every role was restarted from a checkpoint
(:meth:`FailureBook.relaunched`, which also completes a resize's record). Records are dicts, as
``metrics.jsonl`` and the checkpoints' history keep them (``docs/fault-tolerance.md``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from raysinga.actors import placement
from raysinga.obs.events import EventHub, Recovered, Resized, RoleLost

from .elastic import sizes_record


class FailuresExceeded(RuntimeError):
    """More roles were lost than ``fault.max_failures`` allows: every failure, and where the
    run can be resumed from."""

    def __init__(self, failures: list[dict[str, Any]], fault: Any, root: Any) -> None:
        window = f" within {fault.window_s:g} s" if fault.window_s else ""
        lines = [
            f"{len(failures)} failure(s){window}, more than fault.max_failures "
            f"({fault.max_failures}); the run stops:"
        ]
        for f in failures:
            when = time.strftime("%H:%M:%S", time.localtime(f["time"]))
            lines.append(f"  {when} at step {f['step']}: {f['error']}")
        lines.append(f"continue from the newest valid checkpoint in {root} with --resume")
        super().__init__("\n".join(lines))
        self.failures = failures


class FailureBook:
    """Failures and resizes of one run, counted and recorded."""

    def __init__(
        self, fault: Any, root: Any, hub: EventHub, lr_scale: Callable[[Any], float] | None = None
    ) -> None:
        self.fault, self.root, self.hub = fault, root, hub
        # the factor on the learning rate under a topology (JobConfig.lr_scale), recorded with
        # the sizes after each failure and resize
        self.lr_scale = lr_scale or (lambda topo: 1.0)
        self.failures: list[dict[str, Any]] = []  # losses recovered from, with their cost
        self.notes: list[dict[str, Any]] = []  # those, and resizes: the run's history keeps them
        # Until the next launch succeeds: failure records (with their start times), the roles
        # lost, a resize under way, and the topology before them all.
        self.restarting: list[tuple[dict[str, Any], float]] = []
        self.lost_actors: list[Any] = []
        self.resize: tuple[int, float] | None = None
        self.was: Any = None

    def count(
        self, e: BaseException, step: int, chunk: tuple[int, int] | None = None
    ) -> dict[str, Any]:
        """Count a loss detected at ``step`` (``chunk``: the steps its group was running): its
        record so far. More failures than ``fault.max_failures`` (within ``fault.window_s``)
        raise FailuresExceeded, with all."""
        detected = time.time()
        rec = {
            "kind": "failure",
            "step": step,
            "role": getattr(e, "role", "object"),
            "index": getattr(e, "index", None),
            "group": getattr(e, "group", None),
            "error": first_line(e),
            "time": detected,
        }
        fc = self.fault
        known = self.failures + [r for r, _ in self.restarting]
        recent = [f for f in known if not fc.window_s or detected - f["time"] <= fc.window_s]
        if len(recent) + 1 > fc.max_failures:
            raise FailuresExceeded(known + [rec], fc, self.root) from e
        what = {k: rec[k] for k in ("role", "index", "group", "error")}
        n = len(recent) + 1
        self.hub.emit(RoleLost(step, **what, count=n, limit=fc.max_failures, chunk=chunk))
        return rec

    def replaced(
        self, rec: dict[str, Any], t0: float, lost: list[Any], done: Any, redone: int, topo: Any
    ) -> None:
        """The lost roles were replaced in place (``done``: a :class:`replace.Replaced`); the
        group goes on from step ``done.at``, redoing ``redone`` interrupted step(s). Lost
        servers were rebuilt from their copies and the steps logged since. Nothing was rolled
        back."""
        self._complete(
            rec,
            t0,
            lost,
            {
                "recovery": "rebuilt and replayed" if done.rebuilt else "replaced",
                "restored_from": done.at,
                "source": "the live servers" if not done.rebuilt else "copies and the replay log",
                "steps_redone": redone,
                "steps_replayed": done.replayed,
                "rolled_back": 0,
            },
            {**done.phases, **self.sizes(topo, topo)},
        )

    def sizes(self, was: Any, now: Any) -> dict[str, Any]:
        """Groups and workers now (and before, where they changed), and the factor on the
        learning rate that applies from here on."""
        return {**sizes_record(was, now), "lr_scale": self.lr_scale(now)}

    def restarting_from(self, rec: dict[str, Any], t0: float, lost: list[Any], topo: Any) -> None:
        """Every role is being stopped; the record is completed after the next launch."""
        self.restarting.append((rec, t0))
        self.lost_actors += lost
        self.was = self.was or topo

    def resizing(self, step: int, topo: Any) -> None:
        self.resize = (step, time.perf_counter())
        self.was = self.was or topo

    def relaunched(self, source: str, restored: int, topo: Any) -> None:
        """A launch after losses or a resize succeeded: complete their records (when Ray saw
        the role die, the step restored, the steps to redo, the seconds it took)."""
        if self.was is None:
            return
        sizes = self.sizes(self.was, topo)
        for rec, t0 in self.restarting:
            lost = max(0, rec["step"] - restored)
            self._complete(
                rec,
                t0,
                self.lost_actors,
                {
                    "recovery": "restarted",
                    "restored_from": restored,
                    "source": source,
                    "steps_redone": lost,
                    "rolled_back": lost,
                },
                sizes,
            )
        if self.resize is not None and "resized_from" not in sizes:
            # The room a grow was started for was gone by the time the roles were placed (a
            # node just lost may still be listed as alive for a moment): no resize happened.
            self.hub.notice(
                f"raysinga: the room to grow at step {self.resize[0]} was gone when the roles "
                f"were placed; going on with {sizes['groups']} group(s) x {sizes['workers']} "
                "worker(s)"
            )
        elif self.resize is not None:
            step, t0 = self.resize
            info = {
                "kind": "resize",
                "step": step,
                "time": time.time(),
                "restored_from": restored,
                "resize_s": time.perf_counter() - t0,
                **sizes,
            }
            self.notes.append(info)
            self.hub.emit(Resized(info))
        self.restarting, self.lost_actors, self.resize, self.was = [], [], None, None

    def _complete(
        self,
        rec: dict[str, Any],
        t0: float,
        lost: list[Any],
        how: dict[str, Any],
        more: dict[str, Any],
    ) -> None:
        died = placement.first_death(lost)  # by now Ray has recorded the death
        rec.update(
            {
                "died": died,  # as Ray recorded it (None: not known)
                "detection_s": None if died is None else max(0.0, rec["time"] - died),
                **how,
                "restore_s": time.perf_counter() - t0,
                **more,
            }
        )
        self.failures.append(rec)
        self.notes.append(rec)
        self.hub.emit(Recovered(rec))


def first_line(e: BaseException) -> str:
    """An error's first line, as a record or a notice gives it (its type where it says
    nothing)."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__
