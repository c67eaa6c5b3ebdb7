"""Shared buffers: a reader in another process sees the writer's bytes without a copy."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np

from raysinga.actors.common.buffers import (
    SEQ,
    Attachments,
    Layout,
    SharedBuffer,
    UpdateGuard,
    stable_copy,
    with_seq,
)


def _read(handle, q):
    views = Attachments().views(handle)
    q.put({k: v.copy() for k, v in views.items()})


def test_layout_aligns_every_array_and_round_trips_bytes():
    lay = Layout.of({"a": ((3,), "float32"), "b": ((2, 5), "float64"), "c": ((), "int64")})
    assert all(e.offset % 64 == 0 for e in lay.entries)
    raw = np.zeros(lay.nbytes, np.uint8)
    v = lay.views(raw)
    v["b"][...] = np.arange(10).reshape(2, 5)
    np.testing.assert_array_equal(lay.views(raw.copy())["b"], np.arange(10).reshape(2, 5))


def test_another_process_reads_the_buffer_in_place_and_sees_updates():
    buf = SharedBuffer("test", Layout.of({"w": ((4, 4), "float32")}))
    try:
        buf.arrays["w"][...] = 7
        q = mp.get_context("spawn").Queue()
        p = mp.get_context("spawn").Process(target=_read, args=(buf.handle(), q))
        p.start()
        np.testing.assert_array_equal(q.get(timeout=60)["w"], np.full((4, 4), 7, np.float32))
        p.join()
        # A reader that keeps its mapping sees later writes with no new transfer.
        att = Attachments()
        view = att.views(buf.handle())["w"]
        buf.arrays["w"][1, 2] = -1
        assert view[1, 2] == -1 and not view.flags.writeable
    finally:
        buf.close()
    assert not os.path.exists(buf.path)


def test_files_of_dead_processes_are_swept_and_live_ones_kept():
    import subprocess

    from raysinga.actors.common import buffers

    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names no process now
    shm = buffers._shm_dir()
    names = {
        f"raysinga-sweeptest-{os.getpid()}a-g0w0-{gone.pid}": False,
        f"raysinga-sweeptest-{os.getpid()}a-stub0-{gone.pid}-go-w1": False,
        f"raysinga-sweeptest-{os.getpid()}b-server0-{os.getpid()}": True,  # this process: alive
        f"raysinga-sweeptest-{os.getpid()}c-image": True,  # no owner in its name: left alone
    }
    for n in names:
        (shm / n).write_bytes(b"x")
    try:
        assert buffers.remove_stale() >= 2
        for n, kept in names.items():
            assert (shm / n).exists() == kept, n
    finally:
        for n in names:
            (shm / n).unlink(missing_ok=True)


def _update_for(handle_path_q, stop, seconds):
    """The writer of the sequence-lock test: fills its array with 1, 2, 3, ... in place, with
    pauses of up to 2 ms between updates (a server waits for gradients between two)."""
    buf = SharedBuffer("test-seq", with_seq(Layout.of({"w": ((1 << 20,), "float32")})))
    guard = UpdateGuard(buf.arrays[SEQ])
    handle_path_q.put(buf.handle())
    rng = np.random.default_rng(0)
    try:
        v = 0.0
        deadline = time.monotonic() + seconds
        while not stop.is_set() and time.monotonic() < deadline:
            v += 1
            with guard:
                buf.arrays["w"].fill(v)
            time.sleep(rng.uniform(0, 0.002))
    finally:
        stop.wait(30)  # the reader detaches first
        buf.close()


def test_copies_under_the_sequence_lock_never_mix_two_updates():
    """Asynchronous groups read a server's values while it updates them in place: a plain copy
    tears (part old values, part new: the control), a stable copy never does, and the version
    it reports only grows."""
    ctx = mp.get_context("fork")
    q, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_update_for, args=(q, stop, 60))
    p.start()
    try:
        handle = q.get(timeout=30)
        att = Attachments()
        lay = Layout.of({"w": ((1 << 20,), "float32")})
        src, seq = att.flat(handle)[: lay.nbytes], att.views(handle)[SEQ]
        out = np.empty(lay.nbytes, np.uint8)
        torn = 0
        deadline = time.monotonic() + 20
        while torn < 3 and time.monotonic() < deadline:  # the control: plain copies
            np.copyto(out, src)
            w = lay.views(out)["w"]
            torn += int(w.min() != w.max())
        assert torn, "the writer never overlapped a plain copy: the test proves nothing"
        first = last = stable_copy(src, seq, out)
        for _ in range(300):
            version = stable_copy(src, seq, out)
            w = lay.views(out)["w"]
            assert w.min() == w.max() == version, (w.min(), w.max(), version)
            assert version >= last
            last = version
        # the copies were taken while the writer wrote (not after it ran out of time)
        assert last > first + 10, "the writer stopped meanwhile: the test proves nothing"
        del w, src, seq
        att.close()
    finally:
        stop.set()
        p.join(30)
        p.kill()
