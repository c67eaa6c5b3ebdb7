"""A block of one worker sends its gradient as its backward pass makes it
(actors/hostsum/stub_side.py, EarlySends): which server's part may go when. A part goes once its
gradients are final, a GEMM before its layer's dx, except where a reader could still be
reading the values the part would have a server change: the server beside the worker (read
in place there) waits for the layer to be done. A server on another node is read from a
node's mirror, and its next values cross into the node's other mirror: every part of it goes
once final, its last one too."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import actors.exchange.wire as wire
from actors.common.protocol import BlockSend, server_layouts
from actors.common.slicing import plan_slices
from actors.hostsum.worker_side import BlockSums, EarlySends

SHAPES = {"fc1/W": (8, 8), "fc1/b": (8,), "fc2/W": (8, 8), "fc2/b": (8,)}
LAYERS = [["fc2/W", "fc2/b"], ["fc1/W", "fc1/b"]]  # as the backward pass finishes them


class Recorder:
    """An outbox that notes what would cross: (server, part) in the order handed over."""

    def __init__(self, to):
        self.to, self.sent = list(to), []

    def send(self, to, epoch, step, sender, frames, check, part=0, parts=None):
        self.sent += [(self.to.index(t), part) for t in to]
        return 0

    def keep_only(self, to):
        assert list(to) == self.to  # every server the block sends to: none dropped


def sender(beside, monkeypatch, slice_bytes=16):
    monkeypatch.setattr(wire, "PART_BYTES", 96)  # each server's 72 values in 3 parts
    slices = plan_slices(SHAPES, 4, 2, slice_bytes)
    to = (("10.0.0.1", 1, b"a"), ("10.0.0.2", 2, b"b"))
    sums = BlockSums()
    sums.outbox = Recorder(to)
    worker = SimpleNamespace(
        grads=SimpleNamespace(arrays={p: np.zeros(s, np.float32) for p, s in SHAPES.items()}),
        slices=slices,
        block_sums=sums,
        reader=SimpleNamespace(layouts=server_layouts(slices, 2, "float32")),
        wire="f32",
        check_abort=lambda: None,
    )
    return EarlySends(worker, BlockSend(to, 0, beside), 0, 0), sums.outbox


def test_a_layers_final_gradients_go_to_other_nodes_servers_before_its_dx(monkeypatch):
    early, box = sender((True, False), monkeypatch)  # server 0 beside the worker
    plans = early.plans
    assert all(len(p) == 3 for p in plans)
    # which parts hold only fc2's slices: those may go once fc2's gradients are final
    only_fc2 = {
        (k, c)
        for k, p in enumerate(plans)
        for c in range(len(p))
        if early.needs[k][c] <= set(LAYERS[0])
    }
    early.ready(LAYERS[0])
    sent = set(box.sent)
    assert sent == {(1, c) for c in range(3) if (1, c) in only_fc2}  # not beside
    assert sent, "some part of server 1 holds fc2 alone"
    early.done(LAYERS[0])  # fc2's dx done too: server 0's fc2 parts go now
    assert {(0, c) for c in range(2) if (0, c) in only_fc2} <= set(box.sent)
    early.ready(LAYERS[1])  # fc1's final: server 1's every part goes, server 0's last waits
    assert (0, 2) not in box.sent
    assert (1, 1) in box.sent and (1, 2) in box.sent
    early.done(LAYERS[1])
    assert early.finish() == early.sent
    # every part once, each server's in order
    assert sorted(box.sent) == [(k, c) for k in range(2) for c in range(3)]
    for k in range(2):
        assert [c for kk, c in box.sent if kk == k] == [0, 1, 2]


def test_without_knowing_where_the_servers_are_every_part_waits_for_its_layer(monkeypatch):
    early, box = sender((), monkeypatch)
    early.ready(LAYERS[0])
    assert box.sent == []
    early.done(LAYERS[0])
    assert box.sent


@pytest.mark.parametrize("beside", [(False, False), (True, True)])
def test_the_same_parts_go_whatever_goes_early(monkeypatch, beside):
    early, box = sender(beside, monkeypatch)
    for names in LAYERS:
        early.ready(names)
        early.done(names)
    early.finish()
    assert sorted(box.sent) == [(k, c) for k in range(2) for c in range(3)]


def test_rows_told_final_let_a_part_of_them_go_before_the_rest_of_the_gemm(monkeypatch):
    """A dense weight's gradient told final by blocks of rows: a part of a server on another
    node goes once every range it holds is (a part holding any other parameter waits for it);
    each server's parts still in order. The block to compute first is the one holding the
    slice of the first server this block sends to."""
    early, box = sender((False, False), monkeypatch, slice_bytes=64)  # the biases whole
    key = "fc2/W"  # cut over both servers
    pieces = {s.server: (s.start, s.stop) for s in early.worker.slices if s.param == key}
    assert len(pieces) == 2
    bounds = [0, 16, 32, 48, 64]
    assert bounds[early.first_block(key, bounds)] == pieces[early.turn[0]][0]

    def free(k, a, b):  # how many of server k's first parts hold only fc2/W[a:b]
        n = 0
        for ranges in early.ranges[k]:
            if not all(p == key and a <= lo and hi <= b for p, lo, hi in ranges):
                break
            n += 1
        return n

    # the server whose last slices are of fc2/W alone (the other holds fc2/b whole)
    (k,) = [k for k in range(2) if free(k, *pieces[k])]
    a, b = pieces[k]
    early.rows_final(key, a, (a + b) // 2)
    assert box.sent == [(k, c) for c in range(free(k, a, (a + b) // 2))]
    early.rows_final(key, (a + b) // 2, b)
    assert box.sent == [(k, c) for c in range(free(k, a, b))]  # in order, that server alone
    assert len(box.sent) > free(k, a, (a + b) // 2), "the second half let more go"
    for names in LAYERS:
        early.ready(names)
        early.done(names)
    early.finish()
    assert sorted(box.sent) == [(k, c) for k in range(2) for c in range(3)]
    for k in range(2):
        assert [c for kk, c in box.sent if kk == k] == [0, 1, 2]
