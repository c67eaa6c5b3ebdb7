"""The embedded local Ray of a ``raysinga train`` ends with its driver, even one SIGKILLed: no
process of that Ray instance is left (raysinga/cluster/reaper.py). A real run, a real SIGKILL."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from helpers import descendants, train_digits_embedded, trained_to

ROOT = Path(__file__).resolve().parents[2]


def started(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), None where it is gone: a
    pid used again by another process is not taken for the one seen before."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def test_a_sigkilled_driver_leaves_no_process_of_its_embedded_ray(tmp_path):
    """A driver on an embedded Ray SIGKILLed mid-run: within 30 s every process its Ray
    started (GCS server, raylet, the raylet's dashboard and runtime-env agents, the roles) is
    gone. The test ends only the processes of the Ray its own driver started, seen as that
    driver's descendants before the kill."""
    run_dir = tmp_path / "run"
    p = train_digits_embedded(tmp_path, 100000)
    ray_procs: dict[int, tuple[str, int | None]] = {}
    try:
        deadline = time.monotonic() + 240
        while not trained_to(run_dir, 100):
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, "the run never reached step 100"
            time.sleep(0.05)
        ray_procs = {pid: (title, started(pid)) for pid, title in descendants(p.pid)}
        titles = {title for title, _ in ray_procs.values()}
        assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= titles, titles
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        deadline = time.monotonic() + 30
        while (left := [pid for pid, (_, t) in ray_procs.items() if started(pid) == t]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert not left, [ray_procs[pid][0] for pid in left]
    finally:
        p.kill()
        for pid, (_, t) in ray_procs.items():  # this test's own Ray alone, should any be left
            if started(pid) == t:
                os.kill(pid, signal.SIGKILL)
