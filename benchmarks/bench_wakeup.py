"""How late the second of two workers starts when one process rings both, as a server rings a
group's workers each step: with the workers under the default policy and as batch threads
(``SCHED_BATCH``, what raysinga's workers run as: ``kernels/cpu_sched.py``).

Three plain processes, no Ray: the ringer works for ``--work-ms`` (the update), then writes to
each worker's FIFO in turn and waits for both to report; each worker, pinned to a core of its
own (the first two this process may use), notes when it woke and computes for about 3 ms. A
ring is late where the later of the two woke more than 1 ms after the ringer's first write::

    python benchmarks/bench_wakeup.py [--rings 600] [--rounds 3] [--json FILE]

The two variants alternate round by round; each prints the median of its rounds' late rings,
with their minimum and maximum (``--json FILE`` writes every round). There is no goal: it shows
what the workers' policy changes. Needs Linux and two cores.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import struct
import sys
import tempfile
import time

from report import Figure, Report, add_json_option

from raysinga.kernels.cpu_sched import batch_scheduling

MSG = struct.Struct("<d")
LATE_S = 1e-3


def _worker(go: str, back: str, core: int, batch: bool, rings: int) -> None:
    os.sched_setaffinity(0, {core})
    if batch:
        batch_scheduling()  # as a worker's serving thread does
    a, b = os.open(go, os.O_RDWR), os.open(back, os.O_RDWR)
    parent = os.getppid()
    for _ in range(rings):
        while not select.select([a], [], [], 1.0)[0]:
            if os.getppid() != parent:  # the ringer is gone
                os._exit(1)
        os.read(a, MSG.size)
        woke = time.time()
        sum(range(200_000))  # about 3 ms of work
        os.write(b, MSG.pack(woke))
    os._exit(0)


def late_rings(rings: int, work_s: float, batch: bool) -> int:
    d = tempfile.mkdtemp(prefix="bench-wakeup-")
    gos, back = [os.path.join(d, f"go{i}") for i in range(2)], os.path.join(d, "back")
    for p in (*gos, back):
        os.mkfifo(p, 0o600)
    pids = []
    for core, go in zip(sorted(os.sched_getaffinity(0))[:2], gos, strict=True):
        pid = os.fork()
        if pid == 0:
            _worker(go, back, core, batch, rings)
        pids.append(pid)
    fds, b = [os.open(p, os.O_RDWR) for p in gos], os.open(back, os.O_RDWR)
    late, done = 0, False
    try:
        for _ in range(rings):
            t = time.perf_counter()
            while time.perf_counter() - t < work_s:
                pass
            t0 = time.time()
            for fd in fds:
                os.write(fd, MSG.pack(t0))
            buf = b""
            while len(buf) < 2 * MSG.size:
                select.select([b], [], [])
                buf += os.read(b, 2 * MSG.size - len(buf))
            woke = max(MSG.unpack_from(buf, i * MSG.size)[0] for i in range(2))
            late += woke - t0 > LATE_S
        done = True
    finally:
        for pid in pids:
            if not done:  # interrupted: the workers would wait for a ring for ever
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for fd in (*fds, b):
            os.close(fd)
        for p in (*gos, back):
            os.unlink(p)
        os.rmdir(d)
    return late


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rings", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work-ms", type=float, default=2.0, help="the ringer's work before a ring")
    add_json_option(ap)
    a = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2 or not hasattr(os, "SCHED_BATCH"):
        raise SystemExit("bench_wakeup needs Linux and two cores")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the workers and FIFOs cleaned up
    counts: dict[str, list[int]] = {"default policy": [], "SCHED_BATCH": []}
    for _ in range(a.rounds):
        for name in counts:
            counts[name].append(late_rings(a.rings, a.work_ms / 1e3, name == "SCHED_BATCH"))
    report = Report("bench_wakeup", vars(a))
    for name, c in counts.items():
        label = f"workers under {name}: rings of {a.rings} where the second started over 1 ms late"
        report.add(Figure(label, c, ""), ".0f")
    report.write(a.json)


if __name__ == "__main__":
    main()
