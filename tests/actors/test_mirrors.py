"""A node's mirrors of the servers' values (actors/exchange/mirrors.py): what a server pushes lands
in shared memory under its version, as it crossed; a reader waits for the version it was named,
and values that never come report their server lost."""

from __future__ import annotations

import time

import numpy as np
import pytest

import actors.exchange.mirrors as mirrors
from actors.common.buffers import SEQ, Attachments, Layout, SharedBuffer, UpdateGuard, with_seq
from actors.common.errors import ActorLost
from actors.common.protocol import MirrorAt, Published, ServerAt, mirror_seq, updates_later
from actors.exchange.tcp import Outbox
from actors.exchange.wire import encode, rounded

LAYOUTS = [
    Layout.of({"a": ((6,), "float32"), "b": ((3,), "float32")}),
    Layout.of({"c": ((5,), "float32")}),
]


def values(k: int) -> list[np.ndarray]:
    rng = np.random.default_rng(k)
    return [rng.standard_normal(e.shape).astype(np.float32) for e in LAYOUTS[k].entries]


@pytest.fixture
def node():
    m = mirrors.Mirrors("test-mirrors", LAYOUTS, "node", "127.0.0.1")
    box, maps = Outbox(), Attachments()
    yield m, box, maps
    box.close()
    maps.close()
    m.close()


def never() -> None:
    pass


@pytest.mark.parametrize("wire", ["f32", "bf16"])
def test_pushed_values_are_read_at_their_version_as_they_crossed(node, wire):
    m, box, maps = node
    handles = m.describe()["handles"]
    for k in (1, 0):
        box.send([m.describe()["contact"]], 0, 7, k, [encode(values(k), wire)], never)
    for k, lay in enumerate(LAYOUTS):
        at = MirrorAt(handles[k], 7, k)
        mirrors.wait_for(maps, at, never)
        got = maps.views(at.handle)
        want = rounded(dict(zip((e.name for e in lay.entries), values(k), strict=True)), wire)
        for name, arr in want.items():
            assert got[name].tobytes() == arr.tobytes()
        assert got[SEQ][0] == 7


def test_a_reader_waits_for_the_version_it_was_named(node, monkeypatch):
    m, box, maps = node
    contact, handles = m.describe()["contact"], m.describe()["handles"]
    box.send([contact], 0, 3, 0, [values(0)], never)
    mirrors.wait_for(maps, MirrorAt(handles[0], 3, 0), never)
    monkeypatch.setattr(mirrors, "WAIT_S", 0.3)
    with pytest.raises(ActorLost) as e:  # version 4 never comes: server 0 is lost
        mirrors.wait_for(maps, MirrorAt(handles[0], 4, 0), never)
    assert (e.value.role, e.value.index) == ("server", 0)
    assert "did not reach this node" in str(e.value)


def test_a_step_ahead_reads_each_server_as_many_updates_later_and_from_the_other_mirror():
    """What a chunk's later steps read (``Worker.compute_steps``): the first step's sources,
    each that many updates later; a mirror's two buffers are taken in turn."""
    at = MirrorAt(("a", "b"), 3, 1, 7)
    assert updates_later(at, 0) == at
    assert updates_later(at, 2) == MirrorAt(("a", "b"), 5, 1, 7)
    assert (at.handle, updates_later(at, 1).handle) == ("b", "a")
    assert updates_later(ServerAt("h", 4, 0), 3) == ServerAt("h", 7, 0)
    with pytest.raises(TypeError, match="at a version"):
        updates_later(Published("ref"), 1)  # values as published: no version to count from


def test_a_reader_of_a_server_beside_it_waits_for_its_update_to_end(monkeypatch):
    buf = SharedBuffer("test-mirrors-server", with_seq(LAYOUTS[1]))
    maps = Attachments()
    try:
        guard = UpdateGuard(buf.arrays[SEQ])
        guard.set_version(3)
        guard.__enter__()  # update 4 under way: version 4 is not there yet
        monkeypatch.setattr(mirrors, "WAIT_S", 0.3)
        with pytest.raises(ActorLost) as e:
            mirrors.wait_for(maps, ServerAt(buf.handle(), 4, 1), never)
        assert (e.value.role, e.value.index) == ("server", 1)
        guard.__exit__()
        mirrors.wait_for(maps, ServerAt(buf.handle(), 4, 1), never)
    finally:
        maps.close()
        buf.close()


def test_a_wait_ends_with_what_the_check_raises(node):
    m, _, maps = node

    def abort() -> None:
        raise InterruptedError("aborted")

    with pytest.raises(InterruptedError):
        mirrors.wait_for(maps, MirrorAt(m.describe()["handles"][1], 0, 1), abort)


def test_a_frame_that_is_not_a_servers_values_is_dropped(node):
    m, box, maps = node
    contact, handles = m.describe()["contact"], m.describe()["handles"]
    box.send([contact], 0, 1, 5, [values(0)], never)  # no server 5
    box.send([contact], 0, 1, 1, [values(0)], never)  # server 0's arrays for server 1
    box.send([contact], 0, 2, 1, [values(1)], never)
    mirrors.wait_for(maps, MirrorAt(handles[1], 2, 1), never)
    assert [maps.views(h)[SEQ][0] for h in handles[0]] == [-1, -1]


def test_a_version_is_written_once_every_part_is_in_and_a_taken_back_one_never(monkeypatch):
    import actors.exchange.wire as wire

    monkeypatch.setattr(wire, "PART_BYTES", 16)  # server 0's 9 values in 3 parts of 3
    m = mirrors.Mirrors("test-mirrors-parts", LAYOUTS, "node", "127.0.0.1")
    box, maps = Outbox(), Attachments()
    try:
        contact, pair = m.describe()["contact"], m.describe()["handles"][0]
        handle = pair[0]  # the mirror of the even versions
        plan = m.plans[0]
        assert len(plan) == 3
        seq = maps.views(handle)[SEQ]

        def send(version: int, v: list[np.ndarray], parts: range) -> None:
            named = dict(zip(("a", "b"), v, strict=True))
            for c in parts:
                box.send([contact], 0, version, 0, [wire.cut(named, plan[c])], never, c, [3])

        def written() -> int:
            deadline = time.monotonic() + 10
            while m.inbox.received < want_bytes[0] and time.monotonic() < deadline:
                time.sleep(0.01)
            return int(seq[0])

        want_bytes = [0]
        old, new = values(0), [x + 1 for x in values(0)]
        send(4, old, range(2))  # an update taken back after two parts
        want_bytes[0] += 2 * 12
        assert written() == -1
        send(4, new, range(1))  # the same update again: its first part starts it anew
        want_bytes[0] += 12
        assert written() == -1  # parts 1 of the first try and 0 of this one are not all
        send(4, new, range(1, 3))
        mirrors.wait_for(maps, MirrorAt(pair, 4, 0), never)
        got = maps.views(handle)
        assert got["a"].tobytes() + got["b"].tobytes() == new[0].tobytes() + new[1].tobytes()
        box.send([contact], 0, 5, 0, [values(0)], never)  # one part where there are three
        send(6, old, range(3))
        mirrors.wait_for(maps, MirrorAt(pair, 6, 0), never)
        assert got["a"].tobytes() == old[0].tobytes()
    finally:
        box.close()
        maps.close()
        m.close()


def test_a_version_crosses_in_place_into_the_mirror_the_one_before_is_not_read_from(
    monkeypatch,
):
    """Versions take the server's two mirrors in turn: while version 8 crosses part by part,
    version 7 stays whole where its readers read it; the float32 parts are received where
    they are read (no copy aside); the mirror version 9 takes names no version from its first
    part on."""
    import actors.exchange.wire as wire

    monkeypatch.setattr(wire, "PART_BYTES", 16)  # server 0's 9 values in 3 parts of 3
    m = mirrors.Mirrors("test-mirrors-turns", LAYOUTS, "node", "127.0.0.1")
    box, maps = Outbox(), Attachments()
    handed: list[np.ndarray] = []
    fill = m.inbox._sink
    m.inbox._sink = lambda *a: (handed.extend(a[-1]), fill(*a))
    try:
        contact, pair = m.describe()["contact"], m.describe()["handles"][0]
        plan = m.plans[0]
        odd, even = maps.views(pair[1]), maps.views(pair[0])

        def send(version: int, v: list[np.ndarray], parts: range) -> None:
            named = dict(zip(("a", "b"), v, strict=True))
            for c in parts:
                box.send([contact], 0, version, 0, [wire.cut(named, plan[c])], never, c, [3])

        def arrived(n: int) -> None:
            deadline = time.monotonic() + 10
            while m.inbox.received < n * 12 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert m.inbox.received == n * 12

        v7, v8, v9 = values(0), [x + 1 for x in values(0)], [x + 2 for x in values(0)]
        send(7, v7, range(3))
        mirrors.wait_for(maps, MirrorAt(pair, 7, 0), never)
        was = odd["a"].tobytes() + odd["b"].tobytes()
        assert was == v7[0].tobytes() + v7[1].tobytes()
        send(8, v8, range(2))
        arrived(5)
        assert odd[SEQ][0] == 7 and even[SEQ][0] == -1
        assert odd["a"].tobytes() + odd["b"].tobytes() == was  # read as it was
        send(8, v8, range(2, 3))
        mirrors.wait_for(maps, MirrorAt(pair, 8, 0), never)
        assert even["a"].tobytes() + even["b"].tobytes() == v8[0].tobytes() + v8[1].tobytes()
        assert odd[SEQ][0] == 7 and odd["a"].tobytes() + odd["b"].tobytes() == was
        mine = m.bufs[0][0].arrays  # the even mirror as the inbox maps it
        assert len(handed) == 6 and all(
            np.shares_memory(a, mine["a"]) or np.shares_memory(a, mine["b"]) for a in handed[3:]
        )  # each of version 8's arrays was received where its readers read it
        send(9, v9, range(1))
        arrived(7)
        assert odd[SEQ][0] == -1 and even[SEQ][0] == 8  # 7 is read no more: 8 is
    finally:
        box.close()
        maps.close()
        m.close()


@pytest.mark.parametrize("wire", ["f32+zstd", "bf16+zstd", "f32+delta", "bf16+delta"])
def test_a_compressed_push_sends_the_difference_to_a_mirror_that_holds_the_version_before(
    wire,
):
    """Under ``wire: *+zstd`` and ``*+delta`` a server sends a reader that it pushed the
    previous version whole only the difference of the words: the mirror ends with every bit
    of the new values (as they cross), in fewer bytes. A mirror that lacks the version before never
    takes the difference in; after the values are reloaded, the next push is whole."""
    from actors.exchange.wire import parts_of
    from actors.memory.values_out import ValueReaders

    lay = Layout.of({"w": ((4096,), "float32"), "b": ((64,), "float32")})
    m, maps = mirrors.Mirrors("test-deltas", [lay], "node", "127.0.0.1"), Attachments()
    names = [e.name for e in lay.entries]
    readers = ValueReaders(0, wire, parts_of(lay))
    readers.set(True, None, [m.describe()["contact"]])
    handle = m.describe()["handles"][0]
    got = maps.views(handle[0])  # the mirror of the even versions
    rng = np.random.default_rng(3)
    old = {e.name: (rng.standard_normal(e.shape) * 0.05).astype(np.float32) for e in lay.entries}
    step = {
        n: (a * np.float32(1.001) + np.float32(1e-4)).astype(np.float32) for n, a in old.items()
    }
    try:
        readers.publish(old, np.concatenate(list(old.values())), 7, never)  # whole
        assert readers.based == {tuple(m.describe()["contact"]): 7}
        gen = readers.generation
        mirrors.wait_for(maps, MirrorAt(handle, 7, 0, gen), never)
        whole = readers.published.nbytes
        cut = [step[n] for n in names]
        readers.push_part(cut, 8, 0, set(), never, before=[old[n] for n in names])
        pushed = readers.pushed(8)
        mirrors.wait_for(maps, MirrorAt(handle, 8, 0, gen), never)
        for n, want in rounded(step, wire).items():
            assert got[n].tobytes() == want.tobytes(), n
        assert pushed.nbytes < whole
        # a difference for a version the mirror does not hold the one before of: not taken
        readers.based = {k: 9 for k in readers.based}  # (as if 9 had gone whole)
        readers.push_part(cut, 10, 0, set(), never, before=cut)
        time.sleep(0.3)
        assert got[SEQ][0] == mirror_seq(gen, 8)
        readers.forget()
        readers.push_part(cut, 10, 0, set(), never, before=cut)  # whole again
        assert readers.generation != gen
        mirrors.wait_for(maps, MirrorAt(handle, 10, 0, readers.generation), never)
    finally:
        readers.close()
        maps.close()
        m.close()


def test_what_a_mirror_held_before_a_reload_never_passes_for_the_same_version_after(
    monkeypatch,
):
    """A server's values reloaded (a checkpoint, another trial's values: ``forget``) may take
    up a version its mirrors held before, with other values. The push after it is of a new
    generation: a reader named that version of the new values waits for them, never reading
    what the mirrors held."""
    from actors.exchange.wire import parts_of
    from actors.memory.values_out import ValueReaders

    lay = LAYOUTS[1]
    m, maps = mirrors.Mirrors("test-reload", [lay], "node", "127.0.0.1"), Attachments()
    readers = ValueReaders(0, "f32", parts_of(lay))
    readers.set(True, None, [m.describe()["contact"]])
    pair = m.describe()["handles"][0]
    old, new = values(1)[0], values(1)[0] + 1

    def publish(v: np.ndarray, version: int):
        return readers.publish({"c": v}, v, version, never)

    try:
        for version in (8, 9):
            at = MirrorAt(pair, version, 0, publish(old, version).generation)
            mirrors.wait_for(maps, at, never)
        readers.forget()  # reloaded: versions 8 and 9 are no longer those the mirrors hold
        monkeypatch.setattr(mirrors, "WAIT_S", 0.3)
        for version in (8, 9):
            with pytest.raises(ActorLost):
                mirrors.wait_for(maps, MirrorAt(pair, version, 0, readers.generation), never)
        pushed = publish(new, 8)
        assert pushed.generation == readers.generation
        at = MirrorAt(pair, 8, 0, pushed.generation)
        mirrors.wait_for(maps, at, never)
        assert maps.views(at.handle)["c"].tobytes() == new.tobytes()
    finally:
        readers.close()
        maps.close()
        m.close()
