"""Waiting asleep for a counter in shared memory (actors/common/seqwait.py): a process asleep on a
counter another process moves wakes as it is woken, not when its wait runs out."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from actors.common import seqwait
from actors.common.buffers import SEQ, Attachments, Layout, SharedBuffer, UpdateGuard, with_seq

LONG_S = 30.0  # a sleep that only a wake (or the counter already moved) ends early


def _sleeper(handle, q) -> None:
    seq = Attachments().views(handle)[SEQ]
    q.put("asleep")
    t0 = time.monotonic()
    seqwait.sleep_while(seq, 0, LONG_S)
    q.put((time.monotonic() - t0, int(seq[0])))


@pytest.fixture
def counter():
    buf = SharedBuffer("test-seqwait", with_seq(Layout.of({"w": ((4,), "float32")})))
    yield buf
    buf.close()


@pytest.mark.skipif(seqwait._CALL is None, reason="no futexes here")
def test_a_process_asleep_on_a_counter_wakes_when_the_writer_moves_it(counter):
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_sleeper, args=(counter.handle(), q))
    p.start()
    try:
        assert q.get(timeout=60) == "asleep"
        time.sleep(0.3)  # (asleep in the kernel by now, most likely; if not, it sees the 2)
        guard = UpdateGuard(counter.arrays[SEQ])
        guard.__enter__()
        guard.__exit__()  # even again: version 1, and the sleepers woken
        slept, seen = q.get(timeout=LONG_S / 2)
        assert seen == 2
        assert slept < LONG_S / 2
    finally:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


def test_a_sleep_on_a_value_the_counter_no_longer_holds_returns_at_once(counter):
    seq = counter.arrays[SEQ]
    seq[0] = 5
    t0 = time.monotonic()
    seqwait.sleep_while(seq, 4, LONG_S)
    assert time.monotonic() - t0 < LONG_S / 2


def test_a_counter_that_is_not_an_aligned_int64_is_refused():
    if seqwait._CALL is None:
        pytest.skip("no futexes here")
    with pytest.raises(ValueError, match="aligned int64"):
        seqwait.wake(np.zeros(2, np.int32))
