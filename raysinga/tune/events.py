"""What the trials of a search tell an ``on_event`` of :func:`raysinga.tune.trainable` or
:func:`raysinga.tune.in_place` besides their runs' events (:mod:`raysinga.obs.events`), and a
subscriber that writes them down."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from raysinga.obs.events import Event, RunStarted, TrainStep


@dataclass(frozen=True)
class TrialReported:
    """A trial's report handed to Tune (``on_event``'s last event of a report): ``held`` is
    how long the report held the training thread, from the checkpoint's commit on."""

    trial: str
    step: int
    pid: int
    held: float
    segments: int  # the length of the trial's lineage
    forked_from: str = ""  # TRIAL@STEP its state's newest segment started from ("": none)


@dataclass(frozen=True)
class TrialStarted:
    """An in-place trial's run starts in process ``pid`` at ``step``: ``how`` is "fresh", or
    "exploit" (:class:`~raysinga.tune.InPlacePBT` gave it another trial's state in its
    process), or "restore" (Tune started the trial from a checkpoint: after a pause, or a
    failure, or Tune's own exploit)."""

    trial: str
    step: int
    pid: int
    how: str


@dataclass(frozen=True)
class TrialLog:
    """An ``on_event`` for :func:`in_place` (and :func:`~raysinga.tune.trainable`) that appends
    one JSON line per run start, training window and report of every trial to ``path`` (a file
    every trial's node can write), each with the wall-clock time and the trial's process id:
    where a trial ran and when, to time searches by."""

    path: str

    def __call__(self, trial: str, ev: Event) -> None:
        line: dict[str, Any] = {"t": time.time(), "trial": trial, "pid": os.getpid()}
        if isinstance(ev, TrialReported):
            line.update(kind="report", step=ev.step, held=ev.held, segments=ev.segments)
            line["forked_from"] = ev.forked_from
        elif isinstance(ev, TrialStarted):
            line.update(kind="run", step=ev.step, how=ev.how)
        elif isinstance(ev, RunStarted):
            line.update(kind="start", step=ev.step)
        elif isinstance(ev, TrainStep):
            line.update(kind="step", step=ev.step)
        else:
            return
        with open(self.path, "a") as f:  # one short write: lines of several processes do not mix
            f.write(json.dumps(line) + "\n")
