"""Bulk bytes between roles over TCP connections of their own: the blocks' sums of a group
summed by hosts (``topology.reduce: hosts``) go from each block's leader straight to each
server's :class:`Inbox`, not through Ray's object store.

Why: on four emulated hosts at 1 Gbit/s, each host sending 1.9 MB to each of the three others
at once (one step's sums to the servers), Ray's object transfers took 150 to 170 ms where the
same bytes over plain TCP connections took 65 to 75 ms, against 45 ms of link time (median of
8 rounds each). Ray still carries every call, its small results and every error: a frame
carries only arrays.

A frame: the header (:data:`HEAD`: magic, the run's epoch, the step, the sender's block, the
count of arrays, and which part of how many of the sender's message it is), then a table of
one fixed-size entry per array (:data:`ENTRY`: its dtype code, its dimensions, its shape and
its length on the wire), then the arrays' bytes. A sender hands the kernel a frame in one
call, and a receiver takes the header and the table in two, then each array's bytes straight
into where they go: a frame of a few arrays costs a few system calls, not three per array. An
array sent compressed (``wire: *+zstd``, and the values' differences under ``*+delta``:
:mod:`.squeeze`) has
:data:`SQUEEZED` in its code. A connection opens
with the receiving role's token (:data:`HELLO`), which only Ray's calls hand out: a connection
without it is closed unread. Frames of an earlier epoch (a sender replaced since, or one cut
off from the run) are dropped, never summed.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import math
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .squeeze import Squeezed, unsqueeze

MAGIC = b"RSB2"
HELLO = struct.Struct("<4s16s")  # magic, the inbox's token
HEAD = struct.Struct("<4sqqiIHH")  # magic, epoch, step, sender, count of arrays, part, parts
MAX_DIMS = 8
# an array's entry in a frame's table: dtype code, dimensions, shape (MAX_DIMS uint64, those
# past its dimensions 0), bytes on the wire
ENTRY = struct.Struct(f"<BB{MAX_DIMS}QQ")
MAX_ARRAYS = 1 << 16  # the most arrays a frame may carry (a table larger is not a frame)
DTYPES = {0: np.dtype(np.float32), 1: np.dtype(np.uint16)}  # float32, bfloat16 words
CODES = {v: k for k, v in DTYPES.items()}
SQUEEZED = 0x80  # in an array's code: compressed
POLL_S = 0.05  # how often a wait or a blocked send looks for an abort
CONNECT_S = 10.0
BUFFER_BYTES = 4 << 20  # the sockets' kernel buffers asked for (the kernel may cap them)
READER_NICE = 10  # how much lower than the role's other threads its reading threads run
IOV_MAX = 1024  # the most buffers one sendmsg takes (Linux's UIO_MAXIOV)

Address = tuple[str, int]
Check = Callable[[], None]


def payload_bytes(arrays: Sequence[np.ndarray | Squeezed]) -> int:
    """The bytes a frame of ``arrays`` carries besides its headers: what crosses the link."""
    return sum(a.nbytes for a in arrays)


class PeerLost(ConnectionError):
    """The receiving role could not be reached, or its connection broke mid-frame."""

    def __init__(self, where: Address, detail: str) -> None:
        super().__init__(f"{where[0]}:{where[1]}: {detail}")
        self.where = where
        self.every = [where]  # where a send raised it: every receiver it could not reach


Sink = Callable[[int, int, int, int, int, list[np.ndarray]], None]
# where array ``index`` of a frame is to be received: (epoch, step, sender, part, parts, index,
# dtype, shape) -> a writable C-contiguous array of that dtype and size, or None (a new one)
Place = Callable[[int, int, int, int, int, int, np.dtype, tuple[int, ...]], np.ndarray | None]


class Inbox:
    """A role's listening socket for frames from its peers, kept by ``(epoch, step, sender,
    part)`` until :meth:`take` takes them, or each handed to ``sink(epoch, step, sender, part,
    parts, arrays)`` as it comes in. ``place``, where given, names where each uncompressed
    array is received (the kernel copies its bytes there, and nowhere else): the sink's arrays
    are then those. One thread accepts; one per connection reads."""

    def __init__(self, host: str, sink: Sink | None = None, place: Place | None = None) -> None:
        self.sock = socket.create_server((host, 0), backlog=128)
        self.address: Address = (host, self.sock.getsockname()[1])
        self.token = secrets.token_bytes(16)
        self.received = 0  # bytes of the frames taken in
        self.refused = 0  # frames dropped as from an earlier epoch, or connections refused
        self._frames: dict[tuple[int, int, int, int], list[np.ndarray]] = {}
        self._cond = threading.Condition()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._sink, self._place = sink, place
        threading.Thread(target=self._accept, name="inbox-accept", daemon=True).start()

    @property
    def contact(self) -> tuple[str, int, bytes]:
        """What a sender needs (handed over by Ray calls only): address and token."""
        return (*self.address, self.token)

    def take(
        self, epoch: int, step: int, senders: int, check: Check, part: int = 0
    ) -> list[list[np.ndarray]]:
        """The frames of ``step`` under ``epoch`` from senders ``0 .. senders-1`` (their part
        ``part``), in sender order, once all are in; ``check`` runs every :data:`POLL_S`
        meanwhile (it raises to give up). Frames of earlier steps or epochs still kept are
        dropped."""
        keys = [(epoch, step, b, part) for b in range(senders)]
        with self._cond:
            while not all(k in self._frames for k in keys):
                self._cond.wait(POLL_S)
                check()
            got = [self._frames.pop(k) for k in keys]
            stale = [k for k in self._frames if (k[0], k[1]) < (epoch, step)]
            for k in stale:
                del self._frames[k]
            self.refused += len(stale)
        return got

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
        with self._cond:
            conns, self._conns = list(self._conns), set()
            self._frames.clear()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
                c.close()

    # ------------------------------------------------------------------ its threads
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            reader = threading.Thread(target=self._read, args=(conn,), daemon=True)
            reader.start()

    def _refuse(self) -> None:
        with self._cond:
            self.refused += 1

    def _read(self, conn: socket.socket) -> None:
        """Frames from one connection until it ends; a frame cut short is dropped."""
        try:
            _below_compute()
            _tune(conn)
            hello = _recv(conn, HELLO.size)
            magic, token = HELLO.unpack(hello) if hello else (b"", b"")
            if magic != MAGIC or not hmac.compare_digest(token, self.token):
                self._refuse()
                return
            while True:
                head = _recv(conn, HEAD.size)
                if head is None:
                    return
                magic, epoch, step, sender, count, part, parts = HEAD.unpack(head)
                if magic != MAGIC or count > MAX_ARRAYS:
                    self._refuse()
                    return
                into = None
                if self._place is not None:
                    into = functools.partial(self._place, epoch, step, sender, part, parts)
                table = _recv(conn, count * ENTRY.size) if count else b""
                if table is None:
                    raise EOFError("the connection ended inside a frame")
                entries = ENTRY.iter_unpack(table)
                arrays = [_recv_array(conn, e, into, j) for j, e in enumerate(entries)]
                if self._sink is not None:
                    self._sink(epoch, step, sender, part, parts, arrays)
                with self._cond:
                    if self._sink is None:
                        self._frames[(epoch, step, sender, part)] = arrays
                    self.received += sum(a.nbytes for a in arrays)
                    self._cond.notify_all()
        except (OSError, EOFError, ValueError):
            return  # the sender is gone (or sent what is not a frame): nothing of it is kept
        finally:
            with self._cond:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()


class Outbox:
    """A sender's connections, one per receiving role (kept from one step to the next)."""

    def __init__(self) -> None:
        self._conns: dict[Address, socket.socket] = {}
        self._lock = threading.Lock()

    def send(
        self,
        to: Sequence[tuple[str, int, bytes]],
        epoch: int,
        step: int,
        sender: int,
        frames: Sequence[Sequence[np.ndarray]],
        check: Check,
        part: int = 0,
        parts: Sequence[int] | None = None,
    ) -> int:
        """``frames[k]`` to the inbox ``to[k]`` (its :attr:`Inbox.contact`), handed to their
        connections in the order of ``to``, each as part ``part`` of ``parts[k]`` (default
        1) of what the sender sends that receiver for ``step``. Returns the bytes sent (a send
        returns once the kernel's buffer holds the frame, which it does whole at
        :data:`BUFFER_BYTES`: the frames then cross together); raises :class:`PeerLost`
        naming the first receiver that could not be reached (its ``every``: all of them), once
        the others have theirs (its connection is dropped: the next send connects anew), or at
        once what ``check`` raised (it runs every :data:`POLL_S` while a send is blocked).

        Senders that each start from another receiver (sender ``b`` first to receiver
        ``b + 1``, then ``b + 2`` ...) put each receiver's first bytes on one sender's
        connection. Holding each frame back until the one before was delivered (one
        connection per link at a time) was slower on emulated hosts at 1 Gbit/s
        (``docs/concepts.md``)."""
        sent, lost = 0, []
        counts = [1] * len(to) if parts is None else parts
        for c, f, n in zip(to, frames, counts, strict=True):
            try:
                sent += self._send_one(c, (epoch, step, sender, part, n), f, check)
            except PeerLost as e:
                lost.append(e)
        if lost:
            lost[0].every = [e.where for e in lost]
            raise lost[0]
        return sent

    def keep_only(self, to: Sequence[tuple[str, int, bytes]]) -> None:
        """Close the connections to receivers not among ``to`` (every receiver the sender
        sends to now: those replaced are dropped). A send to some of them closes none of the
        others': a connection made anew costs a handshake, a reading thread at the receiver
        and TCP's slow start (the Outbox of a block reconnected to its servers at every step,
        its parts going to some of them at a time)."""
        keep = {(h, p) for h, p, _ in to}
        with self._lock:
            for where in [w for w in self._conns if w not in keep]:
                _close(self._conns.pop(where))

    def close(self) -> None:
        with self._lock:
            for s in self._conns.values():
                _close(s)
            self._conns.clear()

    def _send_one(
        self,
        contact: tuple[str, int, bytes],
        key: tuple[int, int, int, int, int],
        arrays: Sequence[np.ndarray],
        check: Check,
    ) -> int:
        where: Address = (contact[0], contact[1])
        epoch, step, sender, part, parts = key
        head = [HEAD.pack(MAGIC, epoch, step, sender, len(arrays), part, parts)]
        bodies: list[memoryview] = []
        for a in arrays:  # each array's entry in the table, then (after the table) its bytes
            if a.dtype not in CODES or len(a.shape) > MAX_DIMS:
                raise ValueError(f"a frame carries float32 or bfloat16 words, not {a.dtype}")
            dims = (*a.shape, *(0,) * (MAX_DIMS - len(a.shape)))
            squeezed = isinstance(a, Squeezed)
            body = _bytes_of(a.payload if squeezed else a)
            code = CODES[a.dtype] | (SQUEEZED if squeezed else 0)
            head.append(ENTRY.pack(code, len(a.shape), *dims, len(body)))
            bodies.append(body)
        pieces = [b"".join(head), *bodies]
        sock = self._connect(contact)
        try:
            _send_all(sock, pieces, check)
        except BaseException as e:  # broken, or an abort mid-frame: the rest never follows
            with self._lock:
                if self._conns.get(where) is sock:
                    del self._conns[where]
            _close(sock)
            if isinstance(e, OSError):
                raise PeerLost(where, f"the connection broke: {e}") from None
            raise
        return sum(len(p) for p in pieces)

    def _connect(self, contact: tuple[str, int, bytes]) -> socket.socket:
        where: Address = (contact[0], contact[1])
        with self._lock:
            sock = self._conns.get(where)
        if sock is not None:
            return sock
        try:
            sock = socket.create_connection(where, timeout=CONNECT_S)
            _tune(sock)
            sock.settimeout(POLL_S)
            _send_all(sock, [HELLO.pack(MAGIC, contact[2])], lambda: None)
        except OSError as e:
            raise PeerLost(where, f"no connection: {e}") from None
        with self._lock:
            self._conns[where] = sock
        return sock


# ---------------------------------------------------------------------- helpers
def _below_compute() -> None:
    """Lower this thread's scheduling priority by :data:`READER_NICE` (Linux: a thread's own
    nice value). A reading thread only copies bytes the kernel holds already, and what it
    receives is waited for only once a step's every sender is done; where it shares cores
    with a step's computing, the compute goes first."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):  # (no per-thread nice: as it is)
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + READER_NICE)
        )


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER_BYTES)


def _bytes_of(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


def _send_all(sock: socket.socket, pieces: Sequence[Any], check: Check) -> None:
    """``pieces`` (byte buffers), in order, each call handing the kernel all that is left of
    them (one call, where its buffer takes them whole)."""
    views = [v for v in (memoryview(p).cast("B") for p in pieces) if len(v)]
    while views:
        try:
            n = sock.sendmsg(views[:IOV_MAX])
        except TimeoutError:  # the receiver is not taking them in: look for an abort
            check()
            continue
        while n:  # drop what went, and the part of a piece that did
            if n < len(views[0]):
                views[0], n = views[0][n:], 0
            else:
                n -= len(views.pop(0))


def _fill(conn: socket.socket, view: memoryview) -> int:
    """Bytes into ``view`` until it is full or the connection ends; returns how many. The
    kernel fills it whole before it wakes this thread (``MSG_WAITALL``): on a link that
    delivers a frame a few packets at a time, a wake-up per packet would cost the receiving
    process more than the copy itself."""
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if k == 0:
            break
        got += k
    return got


def _recv(conn: socket.socket, n: int) -> bytes | None:
    """Exactly ``n`` bytes, or None where the connection ended before the first; one that
    ends part way raises EOFError."""
    buf = bytearray(n)
    got = _fill(conn, memoryview(buf))
    if got == 0 and n:
        return None
    if got < n:
        raise EOFError("the connection ended inside a frame")
    return bytes(buf)


def _recv_array(
    conn: socket.socket,
    entry: tuple[int, ...],
    into: Callable[[int, np.dtype, tuple[int, ...]], np.ndarray | None] | None = None,
    index: int = 0,
) -> np.ndarray:
    """The next array of a frame, as its ``entry`` in the frame's table (:data:`ENTRY`)
    describes it: where ``into(index, dtype, shape)`` names one that fits (an uncompressed
    array), received into it, else into a new one."""
    code, ndim, *dims = entry
    length = dims.pop()
    if code & ~SQUEEZED not in DTYPES or ndim > MAX_DIMS or any(dims[ndim:]):
        raise ValueError("not a frame of arrays")
    shape = tuple(dims[:ndim])
    if code & SQUEEZED:
        payload = np.empty(length, np.uint8)
        if _fill(conn, memoryview(payload)) < payload.nbytes:
            raise EOFError("the connection ended inside a frame")
        return unsqueeze(payload, DTYPES[code & ~SQUEEZED], shape)
    dtype = DTYPES[code]
    if length != math.prod(shape) * dtype.itemsize:
        raise ValueError("an array whose length is not its shape's")
    out = into(index, dtype, shape) if into is not None else None
    if not _fits(out, dtype, shape):
        out = np.empty(shape, dtype)
    if _fill(conn, memoryview(out).cast("B")) < out.nbytes:
        raise EOFError("the connection ended inside a frame")
    return out.reshape(shape)


def _fits(out: np.ndarray | None, dtype: np.dtype, shape: tuple[int, ...]) -> bool:
    return (
        out is not None
        and out.dtype == dtype
        and out.size == math.prod(shape)
        and out.flags.c_contiguous
        and out.flags.writeable
    )


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
