"""The run directory's writer lock: one writer at a time, a dead writer's lock taken over (at
once on this host, once its lease runs out elsewhere), and a writer paused past its lease told
that it lost the run before it commits beside the new writer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from raysinga.checkpoint import CheckpointError, RunLock, prune, resolve, save, steps

REPO = Path(__file__).resolve().parents[2]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_lock_excludes_a_second_writer(tmp_path):
    with RunLock(resolve(tmp_path)):
        with pytest.raises(CheckpointError, match="another writer"):
            save(tmp_path, 1, {"w": np.ones(2)})
        assert steps(tmp_path) == []
        assert os.path.exists(tmp_path / ".writer.lock")  # the failed save did not release it
    assert not os.path.exists(tmp_path / ".writer.lock")
    save(tmp_path, 1, {"w": np.ones(2)})
    assert not os.path.exists(tmp_path / ".writer.lock")


def test_lock_of_a_dead_process_is_taken_over(tmp_path):
    (tmp_path / ".writer.lock").write_text(f"{socket.gethostname()} {_dead_pid()}")
    save(tmp_path, 1, {"w": np.ones(2)})
    assert steps(tmp_path) == [1]
    assert not os.path.exists(tmp_path / ".writer.lock")


@pytest.mark.parametrize("holder", ["live", "other-host", "garbage"])
def test_lock_of_a_live_or_foreign_holder_is_respected(tmp_path, holder):
    text = {
        "live": f"{socket.gethostname()} {os.getppid()}",
        "other-host": f"not-{socket.gethostname()} {_dead_pid()}",
        "garbage": "???",
    }[holder]
    (tmp_path / ".writer.lock").write_text(text)
    with pytest.raises(CheckpointError, match="another writer"):
        save(tmp_path, 1, {"w": np.ones(2)})
    assert (tmp_path / ".writer.lock").read_text() == text


def test_a_lease_of_a_writer_elsewhere_that_ran_out_is_taken_over(tmp_path):
    """On a filesystem other machines share: a writer of another host stopped renewing. Its
    lease ran out a second ago (its clock), or is seen unrenewed for a lease period (ours)."""
    gone = {"host": "another-machine", "pid": 1, "token": "x", "until": time.time() - 1}
    (tmp_path / ".writer.lock").write_text(json.dumps(gone))
    save(tmp_path, 1, {"w": np.ones(2)})
    assert steps(tmp_path) == [1] and not (tmp_path / ".writer.lock").exists()
    skewed = {**gone, "until": time.time() + 3600}  # its clock an hour ahead of ours
    (tmp_path / ".writer.lock").write_text(json.dumps(skewed))
    t0 = time.monotonic()
    with RunLock(resolve(tmp_path), lease_s=1.0):
        assert 1.0 <= time.monotonic() - t0 < 5.0
        assert json.loads((tmp_path / ".writer.lock").read_text())["host"] == socket.gethostname()


def test_lock_left_half_taken_by_a_killed_writer_is_cleared(tmp_path):
    # a writer SIGKILLed while taking the lock leaves at most its temporary file, never an
    # empty lock that would refuse every later writer
    (tmp_path / f".writer.lock.tmp-{_dead_pid()}").write_text("")
    save(tmp_path, 1, {"w": np.ones(2)})
    assert sorted(os.listdir(tmp_path)) == ["step-1"]


TAKE_OVER = """
import sys
from raysinga.checkpoint import RunLock, resolve, CheckpointError
try:
    RunLock(resolve(sys.argv[1])).acquire()
    print("won", flush=True)
    sys.stdin.read()  # hold it until every contender has answered
except CheckpointError:
    print("refused", flush=True)
"""


def test_two_writers_taking_over_one_dead_lock_cannot_both_win(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for _ in range(3):
        (tmp_path / ".writer.lock").write_text(f"{socket.gethostname()} {_dead_pid()}")
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", TAKE_OVER, str(tmp_path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for _ in range(4)
        ]
        outs = sorted(p.stdout.readline().strip() for p in procs)
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
        assert outs == ["refused"] * 3 + ["won"]


def test_prune_refuses_while_another_writer_holds_the_run(tmp_path):
    save(tmp_path, 1, {"w": np.ones(2)})
    save(tmp_path, 2, {"w": np.ones(2)})
    with RunLock(resolve(tmp_path)):
        (tmp_path / "step-3.tmp-live").mkdir()  # that writer's save in progress
        with pytest.raises(CheckpointError, match="another writer"):
            prune(tmp_path, keep_last=1)
        assert steps(tmp_path) == [2, 1] and (tmp_path / "step-3.tmp-live").exists()
        assert prune(tmp_path, keep_last=1, lock=False) == [1]  # the writer's own call
    with pytest.raises(CheckpointError, match="no such run directory"):
        prune(tmp_path / "nope", keep_last=1)
    assert not (tmp_path / "nope").exists()


PAUSED = """
import sys, time
from raysinga.checkpoint import RunLock, resolve, CheckpointError
lock = RunLock(resolve(sys.argv[1]), lease_s=1.0)
lock.host = "another-machine"  # as a writer elsewhere: this host's pid check does not apply
lock.acquire()
print("held", flush=True)
sys.stdin.readline()  # resumed (SIGCONT) and told to go on
try:
    lock.check()
    print("still holds it", flush=True)
except CheckpointError as e:
    print(e, flush=True)
lock.release()
"""


def test_a_writer_paused_past_its_lease_learns_it_lost_the_run(tmp_path):
    """SIGSTOP a writer (as a stalled machine) past its lease: another takes the run over; the
    paused one, resumed, is refused its next commit, and leaves the new writer's lock alone."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.Popen(
        [sys.executable, "-c", PAUSED, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert p.stdout.readline().strip() == "held"
        os.kill(p.pid, signal.SIGSTOP)
        with RunLock(resolve(tmp_path), lease_s=1.0) as taker:  # waits out the paused lease
            os.kill(p.pid, signal.SIGCONT)
            p.stdin.write("go\n")
            p.stdin.flush()
            told = p.stdout.readline().strip()
            p.wait(timeout=30)
            held = json.loads((tmp_path / ".writer.lock").read_text())
            assert held["token"] == taker.token, "the paused writer took its lock back"
            taker.check()  # the new writer holds it
        assert "lost its writer lock" in told and "took it over" in told, told
        assert socket.gethostname() in told, told
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()


def test_a_lock_record_read_cut_short_on_an_object_store_is_read_again(monkeypatch, tmp_path):
    """A store may serve a read while the holder overwrites the lock, and send part of the old
    body (moto's server does): that is read again, not taken for a lock without a lease. One
    that stays cut short is what the lock file holds, and reported as such."""
    from raysinga.checkpoint import lock  # noqa: PLC0415

    whole = json.dumps({"host": "h", "pid": 1, "token": "t", "until": time.time() + 60}).encode()
    reads = [whole[:-1], whole]
    monkeypatch.setattr(lock, "exists", lambda _: True)
    monkeypatch.setattr(lock, "read_bytes", lambda _: reads.pop(0) if len(reads) > 1 else reads[0])
    held = RunLock(resolve(tmp_path))._read_remote()
    assert held == whole
    reads[:] = [whole[:-1]]
    held = RunLock(resolve(tmp_path))._read_remote()
    assert held == whole[:-1]
    with pytest.raises(CheckpointError, match="if it is gone, remove"):
        RunLock(resolve(tmp_path))._free(held, {})
