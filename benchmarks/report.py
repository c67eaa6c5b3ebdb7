"""What every benchmark prints of a figure, writes with ``--json FILE``, and how the docs show
the latest figures.

A figure is measured in rounds: it is printed as the median with the minimum and maximum of its
rounds, and where it has a goal, as "met" or "not met" against the goal (judged on the median).
``--json FILE`` writes the run's settings, the commit and machine it ran on, and every figure,
its rounds included, so that runs can be compared without parsing the text.

The latest figures of each benchmark are kept as ``benchmarks/results/<benchmark>.json``, and
``docs/benchmarks.md`` shows them in tables drawn from those files::

    python benchmarks/report.py docs docs/benchmarks.md    # redraw the tables
    python benchmarks/report.py show benchmarks/results/bench_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
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
            "commit": commit(),
            "python": sys.version.split()[0],
            "machine": machine(),
            "settings": self.settings,
            "figures": [{**asdict(f), "met": f.met} for f in self.figures],
        }
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"figures written to {path}")


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU since boot, from /proc/stat (Linux)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return sum(fields) - idle, sum(fields)


def quiet(busy_below: float = 0.15, window_s: float = 0.5, at_most_s: float = 30.0) -> float:
    """Wait until the machine is quiet: less than ``busy_below`` of its CPUs busy over two
    windows of ``window_s`` running, at most ``at_most_s``. Returns the seconds waited.

    What a run leaves behind goes on after it returns (Ray's role processes exiting, their
    metrics handed over, shared memory freed) and would be charged to the next contender:
    after a distributed run, the single process timed at once ran at 0.8x its speed of ten
    seconds later. Where /proc/stat cannot be read, it waits ``window_s`` once."""
    t0 = time.monotonic()
    try:
        calm, last = 0, _cpu_times()
    except OSError:
        time.sleep(window_s)
        return time.monotonic() - t0
    while calm < 2 and time.monotonic() - t0 < at_most_s:
        time.sleep(window_s)
        now = _cpu_times()
        busy, total = now[0] - last[0], now[1] - last[1]
        calm = calm + 1 if total and busy / total < busy_below else 0
        last = now
    return time.monotonic() - t0


def commit() -> str:
    """The checked-out commit of this repository, ``-dirty`` where tracked files differ."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> str:
    """The CPU model, its cores and the memory, e.g. "2 cores of AMD EPYC 7B13, 24 GiB"."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        model = found.group(1).strip() if found else model
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return f"{cores} cores of {model}, {mem:.0f} GiB"


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


# ---------------------------------------------------------------- the docs' tables

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = re.compile(r"(<!-- figures: (?P<name>\w+) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)


def _number(v: float) -> str:
    """Three significant digits; thousands separated above 1,000."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def table(doc: dict[str, Any]) -> str:
    """One run's figures as a Markdown table, headed by where and when it ran."""
    when = doc["time"][:10]
    head = (
        f"Latest run: {when}, commit `{doc.get('commit', 'unknown')}`, "
        f"{doc['machine']}, Python {doc['python']}."
    )
    rows = ["| figure | median | min | max | rounds | goal |", "|---|---|---|---|---|---|"]
    for f in doc["figures"]:
        unit = f.get("unit", "").strip()
        goal = ""
        if f.get("goal") is not None:
            bound = "at most" if f["better"] == "lower" else "at least"
            goal = f"{bound} {_number(f['goal'])}: {'met' if f['met'] else '**not met**'}"
        cells = [
            f["name"] + (f" ({unit})" if unit else ""),
            _number(f["value"]),
            _number(min(f["rounds"])),
            _number(max(f["rounds"])),
            str(len(f["rounds"])),
            goal,
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return head + "\n\n" + "\n".join(rows)


def drawn(text: str, results: Path = RESULTS) -> str:
    """``text`` with every ``<!-- figures: NAME -->`` table drawn anew from
    ``results/NAME.json`` (a benchmark without a file there: says so)."""

    def draw(m: re.Match) -> str:
        f = results / f"{m.group('name')}.json"
        body = table(json.loads(f.read_text())) if f.exists() else "No run is recorded."
        return f"{m.group(1)}{body}\n{m.group(4)}"

    return BLOCK.sub(draw, text)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="The docs' tables of benchmark figures.")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("docs", help="redraw the figure tables of Markdown files in place")
    d.add_argument("files", nargs="+", type=Path)
    s = sub.add_parser("show", help="print a --json file's figures as a table")
    s.add_argument("file", type=Path)
    args = ap.parse_args(argv)
    if args.command == "show":
        print(table(json.loads(args.file.read_text())))
        return 0
    for f in args.files:
        f.write_text(drawn(f.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
