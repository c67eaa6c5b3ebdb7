"""Progress as a user sees it: a bar redrawn in place on a terminal, plain lines elsewhere (a file,
a pipe, ``ray job submit`` logs).

:class:`Progress` subscribes to a run's events (:mod:`raysinga.obs.events`): on a terminal, training
events (:class:`~raysinga.obs.events.TrainStep`) update one bar line, with the time left estimated
from the steps done since the bar (re)started; every other event with a console line
(evaluations, checkpoints, failures) is printed above the bar and stays.

A progress library (tqdm) was weighed: it would draw the same bar, but the lines printed above
it, the restart of the estimate after a recovery and the plain output off a terminal would still
be ours to write, so it would save little code for a new dependency.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .console import render
from .events import Event, RunStarted, TrainStep


class Progress:
    WIDTH = 24  # characters of the bar itself

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.bar = ""  # the bar now on screen ("" while none is)
        self._since: tuple[float, int] | None = None  # (time, step) the rate is measured from

    def __call__(self, ev: Event) -> None:
        line = render(ev)
        if isinstance(ev, RunStarted):  # a start or a restart: the estimate starts again
            self._since = None
        if line is None:
            return
        if not self.tty:
            print(line, file=self.stream, flush=True)
        elif isinstance(ev, TrainStep):
            self._update(ev, line)
        else:
            self._erase()
            print(line, file=self.stream)
            self._draw()

    def _update(self, ev: TrainStep, line: str) -> None:
        now = time.monotonic()
        if self._since is None:
            self._since = (now, ev.step)
        filled = min(self.WIDTH, self.WIDTH * ev.step // max(ev.total, 1))
        t0, s0 = self._since
        left = ""
        if s0 < ev.step < ev.total:
            left = f"  {_duration((ev.total - ev.step) * (now - t0) / (ev.step - s0))} left"
        self.bar = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {line}{left}"
        self._draw()

    def close(self) -> None:
        """End the bar's line (the last state stays on screen)."""
        if self.tty and self.bar:
            self.stream.write("\n")
            self.stream.flush()
        self.bar = ""

    def _erase(self) -> None:
        if self.bar:
            self.stream.write("\r\033[K")

    def _draw(self) -> None:
        if self.bar:
            self.stream.write("\r\033[K" + self.bar)
            self.stream.flush()


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"
