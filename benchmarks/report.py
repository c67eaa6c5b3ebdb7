"""What every benchmark prints of a figure, and writes with ``--json FILE``.

A figure is measured in rounds: it is printed as the median with the minimum and maximum of its
rounds, and where it has a goal, as "met" or "not met" against the goal (judged on the median).
``--json FILE`` writes the run's settings and every figure, its rounds included, so that runs
can be compared without parsing the text.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Figure:
    name: str
    rounds: list[float]
    unit: str = ""
    goal: float | None = None  # None: measured for reference
    better: str = "lower"  # "lower": the goal is a ceiling; "higher": a floor
    value: float | None = None  # the figure itself, where it is not the rounds' median

    def __post_init__(self) -> None:
        if not self.rounds:
            raise ValueError(f"figure {self.name!r} has no rounds")
        if self.better not in ("lower", "higher"):
            raise ValueError(f"better must be 'lower' or 'higher', got {self.better!r}")
        self.rounds = [float(r) for r in self.rounds]  # NumPy scalars are not JSON
        self.value = float(statistics.median(self.rounds) if self.value is None else self.value)

    @property
    def met(self) -> bool | None:
        if self.goal is None:
            return None
        return bool(self.value <= self.goal if self.better == "lower" else self.value >= self.goal)

    def line(self, fmt: str = ".3f") -> str:
        lo, hi = min(self.rounds), max(self.rounds)
        n = len(self.rounds)
        text = (
            f"{self.name}: {self.value:{fmt}}{self.unit} (min {lo:{fmt}}, max {hi:{fmt}}, "
            f"{n} round{'s' if n != 1 else ''})"
        )
        if self.goal is not None:
            bound = "at most" if self.better == "lower" else "at least"
            verdict = "met" if self.met else "NOT met"
            text += f"; goal {bound} {self.goal:{fmt}}{self.unit}: {verdict}"
        return text


@dataclass
class Report:
    benchmark: str
    settings: dict[str, Any]
    figures: list[Figure] = field(default_factory=list)

    def add(self, figure: Figure, fmt: str = ".3f") -> Figure:
        """Keep ``figure`` and print its line."""
        self.figures.append(figure)
        print(figure.line(fmt), flush=True)
        return figure

    def write(self, path: str | Path | None) -> None:
        """The whole report as JSON at ``path`` (nothing where None)."""
        if path is None:
            return
        doc = {
            "benchmark": self.benchmark,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "settings": self.settings,
            "figures": [{**asdict(f), "met": f.met} for f in self.figures],
        }
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"figures written to {path}")


def fs_type(path: Path) -> str:
    """The file system ``path`` lies on, as "TYPE on DEVICE" (the longest mount point of it)."""
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, typ, *_ = line.split()
            if str(path).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, f"{typ} on {dev}"
    return kind


def add_json_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", metavar="FILE", default=None, help="also write the figures as JSON")
