"""What a lost server is rebuilt from: a server's copies of itself, and a stub's log of the
summed gradients since (the rebuild itself, with real processes, is in test_recovery.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from raysinga.actors.common.buffers import Layout
from raysinga.actors.common.protocol import server_layouts
from raysinga.actors.common.slicing import plan_slices
from raysinga.actors.memory.copies import CopyBuffer, ServerCopies, take_state
from raysinga.actors.memory.replay import ReplayLog
from raysinga.config import FaultConfig
from raysinga.distributed.replace import replay_steps
from raysinga.optim.optimizers import make_optimizer

SHAPES = {"w": (3, 4), "b": (4,)}


@pytest.fixture
def logs(tmp_path):
    """Makes logs whose rows live in shared memory, closed (their files removed) after."""
    made: list[ReplayLog] = []

    def make(count: int, capacity: int, n_servers: int = 1) -> ReplayLog:
        tag = f"test-{tmp_path.name}-log-stub{len(made)}"
        made.append(ReplayLog(count, "float32", capacity, tag, n_servers=n_servers))
        return made[-1]

    yield make
    for log in made:
        log.close()


def flat_row(step: int) -> np.ndarray:
    return np.arange(16, dtype=np.float32) + 100 * step


def test_the_log_plans_a_rebuild_from_the_copy_through_the_steps_since(logs):
    log = logs(16, 4)
    for step in range(6):
        log.record(step, flat_row(step))
    log.copies[0] = (3, {"version": 3})
    state, rows = log.plan(0, 6)
    assert state == {"version": 3}
    assert [int(log.rows[r][0]) for r in rows] == [300, 400, 500]
    assert log.plan(0, None)[1] == rows  # no live server: up to the newest step logged
    assert log.plan(0, 3)[1] == []  # the copy is the target
    assert log.plan(0, 7) is None  # step 6 was never logged
    assert log.plan(1, 6) is None  # no copy of server 1


def test_a_row_holds_a_step_once_every_server_has_marked_its_share_written(logs):
    log = logs(16, 4, n_servers=2)
    assert log.steps.tolist() == [-1] * 4 and log.unfinished() is None
    log.record(1, flat_row(1))  # the stub's own sum: every share at once
    marks = log.marks  # what each server's SumViews.writing sets in the shared file
    marks[0, 2], marks[1, 2] = 2, -2 - 2  # server 1 lost halfway through step 2
    assert log.steps.tolist() == [-1, 1, -1, -1]
    assert log.unfinished() == 2
    log.copies[1] = (1, {"version": 1})
    assert log.plan(1, 3) is None  # step 2 is not whole: no rebuild through it
    np.copyto(log.begin(2), flat_row(2))  # the stub sums it again (Stub._seal)
    log.commit(2)
    assert log.steps.tolist() == [-1, 1, 2, -1] and log.unfinished() is None
    assert log.plan(1, 3)[1] == [1, 2]
    marks[1, 3] = -2 - 3  # a mark a failed chunk left: nothing writes at a chunk's start
    log.drop_unfinished()
    assert log.unfinished() is None and log.marks[1, 3] == -1


def test_a_copy_older_than_the_log_reaches_back_is_not_rebuilt_from(logs):
    log = logs(16, 4)
    for step in range(8):  # steps 0..3 overwritten by 4..7
        log.record(step, flat_row(step))
    log.copies[0] = (2, {"version": 2})
    assert log.plan(0, 8) is None
    log.copies[0] = (5, {"version": 5})
    assert log.plan(0, 8) is not None


def test_without_a_log_there_is_nothing_to_rebuild_from(logs):
    log = logs(16, 0)
    log.record(0, flat_row(0))
    log.copies[0] = (0, {"version": 0})
    assert log.plan(0, 1) is None
    assert log.plan(0, 0) is not None  # nothing to replay
    assert log.nbytes == 0


def test_a_logged_step_is_cut_into_a_servers_slices_as_its_update_takes_them(logs):
    slices = plan_slices(SHAPES, 4, 2, slice_bytes=16)
    params = Layout.of({p: (s, "float32") for p, s in SHAPES.items()})
    count = params.nbytes // 4
    log = logs(count, 2)
    full = np.zeros(count, np.float32)
    views = params.views(full.view(np.uint8))
    views["w"][...] = np.arange(12).reshape(3, 4)
    views["b"][...] = [-1, -2, -3, -4]
    log.record(0, full)
    for k, lay in enumerate(server_layouts(slices, 2, "float32")):
        got = lay.views(log.server_grads(0, params, slices, k, lay))
        mine = [s for s in slices if s.server == k]
        assert set(got) == {s.name for s in mine}
        for s in mine:
            np.testing.assert_array_equal(got[s.name], views[s.param].reshape(-1)[s.start : s.stop])


def test_a_server_copy_is_taken_in_the_background_and_handed_out_once_newer():
    copies = ServerCopies()
    values = {"w": np.ones(4, np.float32)}
    opt = make_optimizer({"name": "adam", "lr": 0.1})
    opt.update(0, "w", values["w"], np.full(4, 0.5, np.float32))
    assert not copies.due(1)  # no cadence set: no copies
    copies.every = 2
    assert copies.due(1)
    release = threading.Event()

    def take():
        release.wait(5)
        return take_state(values, opt.state_dict(), 1)

    expected = values["w"].tolist()
    copies.start(1, take)
    assert not copies.due(2) and copies.due(3)
    release.set()
    copies.wait_for_copy()  # an update would wait here
    values["w"][...] = 9  # the copy is independent of the live arrays
    state = copies.next_copy(-1)
    assert state["version"] == 1 and state["values"]["w"].tolist() == expected
    assert set(state["optimizer"]["slots"]) == {"w/m", "w/v"}
    assert state["optimizer"]["slots"]["w/m"] is not opt.state_dict()["slots"]["w/m"]
    copies.close()


def test_a_servers_optimizer_state_round_trips_through_its_copy_bit_exact():
    rng = np.random.default_rng(0)
    a, b = (make_optimizer({"name": "adam", "lr": 0.01}) for _ in range(2))
    pa = rng.standard_normal(8).astype(np.float32)
    grads = [rng.standard_normal(8).astype(np.float32) for _ in range(6)]
    for step in range(3):
        a.update(step, "p", pa, grads[step])
    state = take_state({"p": pa}, a.state_dict(), 3)
    pb = state["values"]["p"].copy()
    b.load_state_dict(state["optimizer"])
    for step in range(3, 6):
        a.update(step, "p", pa, grads[step])
        b.update(step, "p", pb, grads[step])
    assert pa.tobytes() == pb.tobytes()


def test_a_copy_in_shared_memory_reads_back_as_taken_and_outlives_the_writer(tmp_path, logs):
    """A server on the stub's node writes its copies into a buffer the stub maps: each into
    the slot not holding the newest, whose readers see the newest whole copy; the stub's
    mapping still reads it once the server's file is gone."""
    rng = np.random.default_rng(1)
    values = {"w[0:8]": rng.standard_normal(8).astype(np.float32), "b": np.zeros(3, np.float32)}
    opt = make_optimizer({"name": "adam", "lr": 0.01})
    opt.update(0, "w[0:8]", values["w[0:8]"], rng.standard_normal(8).astype(np.float32))
    buf = CopyBuffer(f"test-replay-{tmp_path.name}-copies-server0", "node", values, ("m", "v"))
    log = logs(4, 4)
    try:
        log.attach({0: buf.handle()})
        assert log.plan(0, 0) is None  # none taken yet
        buf.write(values, opt.state_dict(), 1)
        first = {k: v.copy() for k, v in values.items()}
        opt.update(1, "b", values["b"], np.ones(3, np.float32))  # "b" has slots from here
        buf.write(values, opt.state_dict(), 2)
        assert buf.arrays["versions"].tolist() == [1, 2]
        values["w[0:8]"][...] = 7  # the copies are independent of the live arrays
        buf.write(values, opt.state_dict(), 3)  # over the older slot, 1
        assert buf.arrays["versions"].tolist() == [3, 2]
        buf.arrays["versions"][0] = -1  # as while a copy is written: the newest whole one
        state, rows = log.plan(0, 2)
        assert state["version"] == 2 and rows == []
        assert state["values"]["w[0:8]"].tobytes() == first["w[0:8]"].tobytes()
        assert set(state["optimizer"]["slots"]) == {"w[0:8]/m", "w[0:8]/v", "b/m", "b/v"}
        assert state["optimizer"]["counts"] == {"b": 1, "w[0:8]": 1}
        assert log.sizes()["copies"] == 1
        buf.arrays["versions"][0] = 3
    finally:
        buf.close()  # the server's file goes (a dead server's is swept): the mapping stays
    state, _ = log.plan(0, 3)
    assert state["version"] == 3 and state["values"]["w[0:8]"].tolist() == [7.0] * 8
    fresh = make_optimizer({"name": "adam", "lr": 0.01})
    fresh.load_state_dict(state["optimizer"])  # as a new server loads it
    assert fresh.counts == {"b": 1, "w[0:8]": 1}
    log.close()


@pytest.mark.parametrize(
    "steps, mb, expected",
    [(20, 256, 20), (20, 1, 2), (0, 256, 0), (1, 256, 0)],
)
def test_the_log_is_bounded_in_steps_and_bytes(steps, mb, expected):
    shapes = {"w": (512, 256)}  # 512 KiB of float32: 2 steps in 1 MiB
    fault = FaultConfig(replay_steps=steps, replay_mb=mb)
    assert replay_steps(fault, shapes, "float32") == expected


def test_without_room_in_shared_memory_the_log_is_the_stubs_own(logs, monkeypatch):
    """A small ``/dev/shm`` (a container's) would kill a process writing past its end: the log
    then lives in the stub's memory, and its servers leave the summing to the stub."""
    import sys

    monkeypatch.setattr(sys.modules[ReplayLog.__module__], "shm_room", lambda nbytes: False)
    log = logs(16, 4)
    assert not log.shared and log.handle() is None
    for step in range(3):
        log.record(step, flat_row(step))
    log.copies[0] = (1, {"version": 1})
    state, rows = log.plan(0, 3)
    assert [int(log.rows[r][0]) for r in rows] == [100, 200]
    monkeypatch.undo()
    assert logs(16, 4).shared  # this machine's /dev/shm has room for 4 rows of 16
