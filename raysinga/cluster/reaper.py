"""The end of an embedded Ray with its driver, however the driver ends.

The Ray that ``ray.init()`` starts for a driver (its GCS server, raylet and log monitor) dies with
the driver, but a raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) outlive a
driver killed outright (SIGKILL, the OOM killer), orphaned. :func:`follow` starts a small process
beside the driver, in a session of its own (a Ctrl-C to the terminal does not reach it), that
follows the processes the embedded Ray started and their children. It learns of the driver's
end from a pipe only the driver holds: when the pipe closes, it ends whatever of them is left
(SIGTERM, then SIGKILL after :data:`GRACE_S`), and exits.

Run as a script (``python -I reaper.py PID...``) it is that process: it imports only the
standard library, so it starts in milliseconds and holds no memory worth counting.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FOLLOW_S = 1.0  # how often the processes followed are looked for new children
GRACE_S = 2.0  # how long a process left behind has after SIGTERM before SIGKILL

_followers: list[Any] = []  # the follower processes of this driver: their pipes stay open


def children(pid: int) -> set[int]:
    """The live child processes of ``pid``."""
    return {p for p, (ppid, _) in _table().items() if ppid == pid}


def follow(pids: set[int]) -> None:
    """End ``pids`` (the processes an embedded Ray started for this driver) and the processes
    descended from them once this driver has ended, however it ended."""
    if not pids:
        return
    _followers.append(
        subprocess.Popen(
            [sys.executable, "-I", __file__, *map(str, sorted(pids))],
            stdin=subprocess.PIPE,  # its other end: this process's, closed when it ends
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
    )


def _table() -> dict[int, tuple[int, int]]:
    """Every live process: pid -> (parent pid, start time in clock ticks since boot); none
    where there is no ``/proc`` (not Linux: nothing is followed there)."""
    out: dict[int, tuple[int, int]] = {}
    if not Path("/proc/self/stat").exists():
        return out
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X"):  # a zombie has ended: its parent has yet to reap it
            out[int(d.name)] = (int(fields[1]), int(fields[19]))
    return out


def _grown(followed: dict[int, int]) -> dict[int, int]:
    """``followed`` (pid -> start time) with every live descendant of those still alive: a
    process is known by its pid and start time, so a pid used again is never taken for it."""
    table = _table()
    alive = {p: t for p, t in followed.items() if table.get(p, (0, -1))[1] == t}
    kids: dict[int, list[int]] = {}
    for p, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(p)
    todo = list(alive)
    while todo:
        for child in kids.get(todo.pop(), []):
            if child not in alive:
                alive[child] = table[child][1]
                todo.append(child)
    return {**followed, **alive}


def _end(followed: dict[int, int]) -> None:
    """SIGTERM to each of ``followed`` still alive, SIGKILL to those alive after GRACE_S."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
        table = _table()
        live = [p for p, t in followed.items() if table.get(p, (0, -1))[1] == t]
        for p in live:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            time.sleep(0.05)
            table = _table()
            live = [p for p in live if table.get(p, (0, -1))[1] == followed[p]]
        if not live:
            return


def main(pids: list[int]) -> None:
    table = _table()
    followed = {p: table[p][1] for p in pids if p in table}
    while True:
        ready, _, _ = select.select([0], [], [], FOLLOW_S)
        if ready and not os.read(0, 4096):  # the driver's end of the pipe closed: it ended
            break
        followed = _grown(followed)
    _end(_grown(followed))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]])
