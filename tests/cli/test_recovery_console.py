"""What the console of ``raysinga train`` shows of a loss the run recovers from: one line for the
loss and one for the recovery, naming one story's steps, and no traceback of Ray's; Ray's own
account of the dead process is in the run's ``ray.log``. A real run, a real SIGKILL."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from helpers import descendants, train_digits_embedded, trained_to

from raysinga.obs.console import render
from raysinga.obs.events import Recovered, RoleLost

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # Ray's start and a run of 6000 steps
def test_a_recovered_worker_loss_is_two_lines_and_no_traceback(tmp_path):
    """``examples/digits_mlp.yaml`` on an embedded Ray; one worker in its serve loop SIGKILLed
    mid-run. The run finishes; its console holds no ``Traceback`` and no ``Unhandled error``
    (the lost worker's peers' aborted calls, which Ray printed from the stub), one line for the
    loss and one for the recovery; the step the recovery goes on from is within the steps the
    loss line names; Ray's message about the dead worker is in ``ray.log``."""
    run_dir = tmp_path / "run"
    p = train_digits_embedded(tmp_path, 6000)
    killed = None
    try:
        deadline = time.monotonic() + 240
        while not trained_to(run_dir, 300):
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, "the run never reached step 300"
            time.sleep(0.05)
        # a worker of the group in its serve loop (between two chunks it waits idle, as a
        # spare worker does, titled ray::Worker)
        while not (serving := [w for w, t in descendants(p.pid) if t == "ray::Worker.serve"]):
            assert p.poll() is None and time.monotonic() < deadline, descendants(p.pid)
            time.sleep(0.01)
        killed = serving[0]
        os.kill(killed, signal.SIGKILL)
        out, _ = p.communicate(timeout=240)
    finally:
        p.kill()
    assert p.returncode == 0, out
    # nothing of Ray's about the loss: no traceback, no raylet's message
    for said in ("Traceback", "Unhandled error", "(raylet)"):
        assert said not in out, out
    lost = [line for line in out.splitlines() if "was lost" in line]
    back = [line for line in out.splitlines() if line.startswith("raysinga: recovered in")]
    assert len(lost) == 1 and len(back) == 1, out
    (rec,) = [
        r
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "failure"
    ]
    assert rec["recovery"] == "replaced", rec
    # one story: the recovery's step lies in the steps the loss line names
    span = re.search(r"in steps (\d+) to (\d+)", lost[0])
    assert span, lost[0]
    assert int(span[1]) <= rec["restored_from"] <= int(span[2]), (lost[0], rec)
    assert f"from step {rec['restored_from']}, where the group's servers stood" in back[0]
    # what Ray said of the dead worker: in the run's ray.log
    assert f"Worker PID: {killed}" in (run_dir / "ray.log").read_text()


def test_the_lines_of_one_loss_tell_one_story():
    """The console lines of a loss noticed while its group ran a chunk of steps (the driver
    had last heard of step 6000), and of its recovery at step 6464 where the servers stood."""
    lost = RoleLost(6000, "worker", 1, 0, "worker 1 of group 0 was lost: died", 1, 3, (6000, 6500))
    assert render(lost) == (
        "raysinga: worker 1 of group 0 was lost: died in steps 6000 to 6500 (its group's chunk "
        "under way); recovering (failure 1 of at most 3)"
    )
    info = {"restore_s": 0.11, "restored_from": 6464, "steps_redone": 1, "recovery": "replaced"}
    assert render(Recovered(info)) == (
        "raysinga: recovered in 0.11 s from step 6464, where the group's servers stood "
        "(1 step(s) to redo)"
    )
    # a loss outside a chunk (while checkpointing, launching): the step the driver knows
    between = RoleLost(6000, "server", 0, None, "server 0 was lost: died", 2, 3)
    assert " at step 6000; recovering (failure 2 of at most 3)" in render(between)
    info = {"restore_s": 2.0, "restored_from": 5000, "steps_redone": 1000, "recovery": "restarted"}
    assert "from step 5000, every role restarted (1000 step(s) to redo)" in render(Recovered(info))
