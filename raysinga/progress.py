"""Progress as a user sees it: a bar redrawn in place on a terminal, plain lines elsewhere (a file,
a pipe, ``ray job submit`` logs).

The trainers report through a ``log(line)`` callback. :class:`Progress` is that callback for the
CLI: on a terminal, training lines (``step N/T  epoch ...``) update one bar line, with the time
left estimated from the steps done since the bar (re)started; every other line (evaluations,
checkpoints, failures) is printed above the bar and stays.
"""

from __future__ import annotations

import re
import sys
import time
from typing import TextIO

TRAIN_LINE = re.compile(r"step\s+(\d+)/(\d+)\s+epoch")


class Progress:
    WIDTH = 24  # characters of the bar itself

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.bar = ""  # the bar now on screen ("" while none is)
        self._since: tuple[float, int] | None = None  # (time, step) the rate is measured from
        self._last = -1

    def __call__(self, line: str) -> None:
        if not self.tty:
            print(line, file=self.stream, flush=True)
            return
        m = TRAIN_LINE.match(line)
        if m is None:
            self._erase()
            print(line, file=self.stream)
            self._draw()
            return
        step, total = int(m.group(1)), int(m.group(2))
        now = time.monotonic()
        if self._since is None or step < self._last:  # the start, or a restart from a checkpoint
            self._since = (now, step)
        self._last = step
        filled = min(self.WIDTH, self.WIDTH * step // max(total, 1))
        t0, s0 = self._since
        left = ""
        if step > s0 and step < total:
            left = f"  {_duration((total - step) * (now - t0) / (step - s0))} left"
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
