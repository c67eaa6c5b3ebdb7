"""Frames of arrays between roles over TCP connections of their own (actors/exchange/tcp.py): what a
block's leader sends a server's inbox, taken in sender order, under the run's epoch; what a
broken, cut off or foreign connection leaves (nothing)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from actors.exchange.squeeze import squeeze, unsqueeze
from actors.exchange.tcp import (
    ENTRY,
    HEAD,
    HELLO,
    MAGIC,
    MAX_DIMS,
    SQUEEZED,
    Inbox,
    Outbox,
    PeerLost,
    payload_bytes,
)


class Aborted(Exception):
    pass


def never() -> None:
    pass


def after(seconds: float):
    """A check that raises once ``seconds`` have passed (an abort coming)."""
    end = time.monotonic() + seconds

    def check() -> None:
        if time.monotonic() > end:
            raise Aborted

    return check


def wait_until(done, seconds: float = 60.0) -> None:
    """Until ``done()`` holds, at most ``seconds``. The inbox's reading threads run below the
    process's others (``READER_NICE``): on a machine busy with other tests they may wait
    seconds for a core, so the bound is generous; a test that holds returns at once."""
    end = time.monotonic() + seconds
    while not done() and time.monotonic() < end:
        time.sleep(0.02)


def closed_by_the_inbox(c: socket.socket) -> bool:
    """Whether the inbox closed connection ``c`` (its end of it reads as ended), waiting at
    most 60 s. The inbox forgets a connection before closing it, so once this holds its
    ``_conns`` no longer has it; testing ``_conns`` alone could pass before the inbox had
    even accepted the connection."""
    c.settimeout(60)
    try:
        return c.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture
def inbox():
    box = Inbox("127.0.0.1")
    yield box
    box.close()


def frames(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal((3, 5)).astype(np.float32),
        rng.integers(0, 2**16, 7, dtype=np.uint16),  # bfloat16 words
        np.zeros(0, np.float32),
    ]


def test_frames_are_taken_in_sender_order_with_their_bits_and_shapes(inbox):
    sent = {b: frames(b) for b in range(3)}
    boxes = [Outbox() for _ in range(3)]
    try:
        for b in (2, 0, 1):  # arriving in any order
            n = boxes[b].send([inbox.contact], 4, 10, b, [sent[b]], never)
            assert n > sum(a.nbytes for a in sent[b])  # with its header
        got = inbox.take(4, 10, 3, after(10))
    finally:
        for box in boxes:
            box.close()
    for b, arrays in enumerate(got):
        assert [a.dtype for a in arrays] == [a.dtype for a in sent[b]]
        assert [a.shape for a in arrays] == [a.shape for a in sent[b]]
        assert all(x.tobytes() == y.tobytes() for x, y in zip(arrays, sent[b], strict=True))
    assert inbox.received == sum(a.nbytes for f in sent.values() for a in f)


def test_a_frame_larger_than_the_kernels_buffers_crosses_whole_in_one_pieces_order(inbox):
    """A frame goes to the kernel in one call where it fits: one larger than the sockets'
    buffers goes in several, some ending inside an array; the arrays arrive whole, in order."""
    rng = np.random.default_rng(1)
    big = [rng.standard_normal(n).astype(np.float32) for n in (1_500_001, 3, 2_000_000)]
    box = Outbox()
    try:
        sender = threading.Thread(target=box.send, args=([inbox.contact], 0, 1, 0, [big], never))
        sender.start()
        (got,) = inbox.take(0, 1, 1, after(20))
        sender.join(20)
    finally:
        box.close()
    assert [a.tobytes() for a in got] == [a.tobytes() for a in big]


@pytest.mark.parametrize("bad", ["dims past its dimensions", "length not its shape's"])
def test_a_frame_whose_table_does_not_describe_its_arrays_is_dropped_with_its_connection(
    inbox, bad
):
    dims = [5, 0, 0, 0, 0, 0, 0, 0]
    length = 20
    if bad == "dims past its dimensions":
        dims[3] = 2
    else:
        length = 24
    with socket.create_connection(inbox.address) as c:
        c.sendall(HELLO.pack(MAGIC, inbox.token) + HEAD.pack(MAGIC, 0, 1, 0, 1, 0, 1))
        c.sendall(ENTRY.pack(0, 1, *dims, length) + b"\0" * length)
        assert closed_by_the_inbox(c)
    assert not inbox._conns and inbox.received == 0


def test_arrays_are_received_where_the_inbox_places_them_and_elsewhere_where_they_do_not_fit():
    """``place`` names where each uncompressed array lands: there, bit for bit, where it is
    one of the array's dtype and size (whatever its shape); else in a new array."""
    room = np.zeros(32, np.float32)
    asked: list[tuple] = []

    def place(epoch, step, sender, part, parts, j, dtype, shape):
        asked.append((epoch, step, sender, part, parts, j, dtype, shape))
        if j == 0:
            return room[:15]  # fits the (3, 5) float32 array
        return room[:7]  # the bfloat16 words do not fit float32 room: a new array

    got: list[list[np.ndarray]] = []
    box, out = Inbox("127.0.0.1", sink=lambda *a: got.append(a[-1]), place=place), Outbox()
    try:
        sent = frames(1)
        out.send([box.contact], 2, 9, 1, [sent], never, 0, [1])
        wait_until(lambda: got)
    finally:
        out.close()
        box.close()
    (arrays,) = got
    assert all(x.tobytes() == y.tobytes() for x, y in zip(arrays, sent, strict=True))
    assert arrays[0].shape == (3, 5) and np.shares_memory(arrays[0], room)
    assert room[:15].tobytes() == sent[0].tobytes() and not room[15:].any()
    assert not np.shares_memory(arrays[1], room) and arrays[1].dtype == np.uint16
    assert [a[:6] for a in asked] == [(2, 9, 1, 0, 1, j) for j in range(3)]
    assert asked[1][6:] == (np.dtype(np.uint16), (7,))


def weights(n: int, seed: int = 0) -> np.ndarray:
    """float32 values as a layer holds them: small, of few exponents."""
    return (np.random.default_rng(seed).standard_normal(n) * 0.05).astype(np.float32)


def test_squeezed_arrays_cross_bit_for_bit_in_fewer_bytes(inbox):
    """``wire: *+zstd``: float32 values and bfloat16 words, their bytes grouped by
    significance and compressed, arrive with every bit, and the frame is smaller."""
    w = weights(1 << 16).reshape(256, 256)
    bf = (w.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 words of them
    odd = np.array([np.nan, -0.0, np.inf, 1e-45, -3.4e38], np.float32)  # every bit kept
    plain = [w, bf, odd, np.zeros(0, np.float32)]
    squeezed = [squeeze(a) for a in plain]
    assert payload_bytes(squeezed[:2]) < 0.9 * payload_bytes(plain[:2])
    box = Outbox()
    try:
        n = box.send([inbox.contact], 0, 1, 0, [squeezed], never)
        (got,) = inbox.take(0, 1, 1, after(10))
    finally:
        box.close()
    assert n < payload_bytes(plain)
    for a, b in zip(got, plain, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert inbox.received == payload_bytes(plain)  # the arrays as taken in


def test_a_squeezed_array_groups_its_bytes_by_significance():
    """What is compressed: every element's first byte, then every second byte, ... (the
    sign and exponent bytes together), for float32 and bfloat16 words alike."""
    import pyarrow as pa

    w = weights(1001)
    for a in (w, (w.view(np.uint32) >> 16).astype(np.uint16)):
        s = squeeze(a)
        raw = pa.Codec("zstd").decompress(s.payload, decompressed_size=a.nbytes)
        planes = np.frombuffer(raw, np.uint8).reshape(a.itemsize, -1)
        assert (planes == a.view(np.uint8).reshape(-1, a.itemsize).T).all()
        assert unsqueeze(s.payload, a.dtype, a.shape).tobytes() == a.tobytes()


def test_a_squeezed_array_that_does_not_decompress_is_dropped_with_its_connection(inbox):
    s = squeeze(weights(1000))
    with pytest.raises(ValueError, match="does not decompress|another size"):
        unsqueeze(s.payload[:-7], np.dtype(np.float32), (1000,))
    with socket.create_connection(inbox.address) as c:
        c.sendall(HELLO.pack(MAGIC, inbox.token) + HEAD.pack(MAGIC, 0, 1, 0, 1, 0, 1))
        junk = b"not zstd at all" * 10
        c.sendall(ENTRY.pack(0 | SQUEEZED, 1, 1000, *(0,) * (MAX_DIMS - 1), len(junk)) + junk)
        assert closed_by_the_inbox(c)
    assert not inbox._conns and inbox.received == 0
    with pytest.raises(Aborted):
        inbox.take(0, 1, 1, after(0.2))


def test_one_send_reaches_several_inboxes_and_the_connections_are_kept():
    inboxes = [Inbox("127.0.0.1") for _ in range(3)]
    box = Outbox()
    try:
        for step in (1, 2):
            box.send([i.contact for i in inboxes], 0, step, 0, [frames(k) for k in range(3)], never)
            for k, i in enumerate(inboxes):
                (got,) = i.take(0, step, 1, after(10))
                assert got[0].tobytes() == frames(k)[0].tobytes()
        assert len(box._conns) == 3
    finally:
        box.close()
        for i in inboxes:
            i.close()


def test_a_send_to_some_receivers_keeps_the_others_connections_until_they_are_replaced():
    """A block sends its parts to the servers some at a time: each send used to close the
    connections to the others, and every step connected anew (a handshake, a reading thread
    at the receiver, TCP's slow start)."""
    inboxes = [Inbox("127.0.0.1") for _ in range(3)]
    box = Outbox()
    try:
        contacts = [i.contact for i in inboxes]
        box.send(contacts, 0, 1, 0, [frames(k) for k in range(3)], never)
        kept = dict(box._conns)
        for step in (2, 3):
            for k, c in enumerate(contacts):  # one receiver at a time
                box.send([c], 0, step, 0, [frames(k)], never)
                assert (
                    inboxes[k].take(0, step, 1, after(10))[0][0].tobytes() == frames(k)[0].tobytes()
                )
        assert box._conns == kept  # the same sockets: none closed, none made anew
        box.keep_only(contacts[1:])  # the first receiver replaced
        assert set(box._conns) == {i.address for i in inboxes[1:]}
    finally:
        box.close()
        for i in inboxes:
            i.close()


def test_each_receiver_gets_its_frame_and_one_lost_stops_no_other():
    inboxes = [Inbox("127.0.0.1") for _ in range(3)]
    box = Outbox()
    try:
        contacts = [i.contact for i in inboxes]
        box.send(contacts, 0, 1, 0, [frames(k) for k in range(3)], never)
        inboxes[0].close()
        with pytest.raises(PeerLost) as e:
            for step in range(2, 50):  # the first writes may land in the kernel's buffers
                big = [[np.full(1 << 20, step, np.float32)]] * 3
                box.send(contacts, 0, step, 0, big, never)
        assert e.value.where == inboxes[0].address
        for i in inboxes[1:]:  # the receivers after the lost one got every step
            (got,) = i.take(0, step, 1, after(10))
            assert got[0][0] == step
    finally:
        box.close()
        for i in inboxes:
            i.close()


def test_a_wait_for_frames_that_do_not_come_ends_with_what_the_check_raises(inbox):
    t0 = time.monotonic()
    with pytest.raises(Aborted):
        inbox.take(0, 1, 1, after(0.3))
    assert time.monotonic() - t0 < 5


def test_frames_of_an_earlier_epoch_are_never_taken_and_are_dropped(inbox):
    box = Outbox()
    try:
        box.send([inbox.contact], 1, 7, 0, [frames(0)], never)  # a step then interrupted
        box.send([inbox.contact], 2, 7, 0, [frames(1)], never)  # redone under the next epoch
        (got,) = inbox.take(2, 7, 1, after(10))
        assert got[0].tobytes() == frames(1)[0].tobytes()
        assert inbox.refused == 1 and not inbox._frames
        with pytest.raises(Aborted):  # and the old one is not there to take
            inbox.take(1, 7, 1, after(0.2))
    finally:
        box.close()


def test_a_connection_without_the_token_is_closed_unread(inbox):
    with socket.create_connection(inbox.address) as s:
        s.sendall(HELLO.pack(MAGIC, b"\0" * 16) + HEAD.pack(MAGIC, 0, 1, 0, 1, 0, 1))
        s.settimeout(10)
        try:  # closed by the inbox (reset: what it left unread)
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
    assert inbox.refused == 1
    box = Outbox()
    try:
        box.send([inbox.contact], 0, 1, 0, [frames(0)], never)
        assert len(inbox.take(0, 1, 1, after(10))) == 1
    finally:
        box.close()


def test_a_frame_cut_short_by_its_sender_is_dropped(inbox):
    with socket.create_connection(inbox.address) as s:
        s.sendall(HELLO.pack(MAGIC, inbox.token) + HEAD.pack(MAGIC, 0, 1, 0, 1, 0, 1))
        s.sendall(bytes([0, 1]) + (1000).to_bytes(8, "little") + b"\0" * 100)  # 100 of 4000
    with pytest.raises(Aborted):
        inbox.take(0, 1, 1, after(0.5))
    assert not inbox._frames


def test_a_receiver_gone_is_named_and_the_next_send_connects_anew():
    gone, live = Inbox("127.0.0.1"), Inbox("127.0.0.1")
    box = Outbox()
    try:
        box.send([gone.contact, live.contact], 0, 1, 0, [frames(0), frames(1)], never)
        gone.close()
        with pytest.raises(PeerLost) as e:
            for step in range(2, 50):  # the first writes may land in the kernel's buffers
                box.send([gone.contact], 0, step, 0, [[np.zeros(1 << 20, np.float32)]], never)
        assert e.value.where == gone.address
        assert gone.address not in box._conns
        replaced = Inbox("127.0.0.1")  # its replacement, elsewhere: the old one is let go
        try:
            box.send([replaced.contact, live.contact], 0, 2, 0, [frames(2), frames(3)], never)
            assert replaced.take(0, 2, 1, after(10))[0][0].tobytes() == frames(2)[0].tobytes()
            assert set(box._conns) == {replaced.address, live.address}
        finally:
            replaced.close()
    finally:
        box.close()
        live.close()


def test_a_send_blocked_by_a_receiver_that_takes_nothing_in_ends_with_the_abort():
    """The receiver's host went silent: the send stops at the abort, its connection dropped
    (the rest of the frame never follows what was sent)."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    contact = (*listener.getsockname(), b"t" * 16)
    box = Outbox()
    try:
        t0 = time.monotonic()
        with pytest.raises(Aborted):
            box.send([contact], 0, 1, 0, [[np.zeros(64 << 20, np.float32)]], after(0.5))
        assert time.monotonic() - t0 < 10
        assert not box._conns
    finally:
        box.close()
        listener.close()
        for conn, _ in accepted:
            conn.close()


def test_an_unknown_dtype_is_refused_before_anything_is_sent(inbox):
    box = Outbox()
    try:
        with pytest.raises(ValueError, match="float32 or bfloat16"):
            box.send([inbox.contact], 0, 1, 0, [[np.zeros(3, np.float64)]], never)
    finally:
        box.close()


def test_a_reading_thread_runs_below_its_roles_other_threads():
    """Where a role's compute and its reading threads want the same core, the compute goes
    first: each connection's reading thread runs at a nice value READER_NICE above the
    process's (Linux)."""
    import os

    from actors.exchange.tcp import READER_NICE

    def nices() -> dict[str, int]:  # by thread id
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    out[tid] = int(f.read().rsplit(")", 1)[1].split()[16])
            except FileNotFoundError:  # a thread (another test's, Ray's) ended meanwhile
                continue
        return out

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no per-thread nice values to read here")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    before = nices()
    inbox, box = Inbox("127.0.0.1"), Outbox()
    try:
        box.send([inbox.contact], 0, 1, 0, [frames(0)], never)
        inbox.take(0, 1, 1, after(10))  # its reading thread is running
        started = {t: n for t, n in nices().items() if t not in before}
    finally:
        box.close()
        inbox.close()
    # the connection's reading thread below, the inbox's accepting thread (if new) not
    assert sorted(started.values()) in (
        [min(19, base + READER_NICE)],
        [base, min(19, base + READER_NICE)],
    )
