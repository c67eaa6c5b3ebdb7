"""TensorBoard event files of a run's scalar metrics, written by tensorboardX.

Each numeric field of a metrics record becomes one scalar tagged ``<kind>/<field>``
(``train/loss``, ``eval/test_accuracy``, ``checkpoint/seconds``) at the record's step and wall
time. Point TensorBoard at the runs' parent directory (``tensorboard --logdir runs``) to see runs
side by side.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

SUBDIR = "tensorboard"  # under the run directory
SUFFIX = ".raysinga"  # of the event files a run writes, so that it finds its own again
# the x axis, wall-clock instants and role identifiers: numbers that are not metrics
_SKIP = {"step", "time", "died", "index", "group"}


def record_scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The scalars of one metrics record, by tag."""
    kind = rec.get("kind", "metrics")
    return {
        f"{kind}/{k}": float(v)
        for k, v in rec.items()
        if k not in _SKIP and isinstance(v, int | float) and not isinstance(v, bool)
    }


class EventWriter:
    """Appends metrics records to a new event file in ``run_dir/tensorboard``.

    A run rewrites its metrics from its history each time it starts (as ``metrics.jsonl`` is
    rewritten), so the event files an earlier start of this run left there are removed first:
    TensorBoard would otherwise draw the steps before a resume twice."""

    def __init__(self, run_dir: Path) -> None:
        from tensorboardX import SummaryWriter  # noqa: PLC0415 - only where a run asks for it

        self.dir = Path(run_dir) / SUBDIR
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.glob(f"events.out.tfevents.*{SUFFIX}"):
            old.unlink()
        self.writer = SummaryWriter(str(self.dir), filename_suffix=SUFFIX)

    def record(self, rec: dict[str, Any]) -> None:
        scalars = record_scalars(rec)
        if scalars and isinstance(rec.get("step"), int):
            when = rec.get("time", time.time())
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, rec["step"], walltime=when)
            self.writer.flush()  # a run that dies leaves what it recorded

    def close(self) -> None:
        self.writer.close()
