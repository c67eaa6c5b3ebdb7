"""Doorbells: fixed-size messages over named pipes, the per-step control path within one node.

A Ray actor call costs 1-3 ms on a loaded two-core machine, and a synchronous group makes three
rounds of them per step. When a group's workers, servers and stub share a node, the stub instead
rings each role through a FIFO in ``/dev/shm``: a blocked reader sleeps in the kernel (no spinning
on the cores the workers need) and wakes within microseconds. Data still moves through the shared
buffers; Ray calls still start and end each chunk of steps and carry every error.
"""

from __future__ import annotations

import os
import select
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..common.protocol import Go, Published, Wiring

# A message class of :mod:`.protocol`: a NamedTuple whose ``FORMAT`` is its struct format.
Message = TypeVar("Message", bound=tuple)


class DoorbellTimeout(TimeoutError):
    pass


class Doorbell(Generic[Message]):
    """One FIFO carrying messages of one class (e.g. :class:`.protocol.WorkerDone`); many
    writers, one reader."""

    def __init__(self, path: str, message: type[Message]) -> None:
        self.path, self.message = path, message
        self.struct = struct.Struct(message.FORMAT)  # type: ignore[attr-defined]
        if self.struct.size > select.PIPE_BUF:
            raise ValueError("a doorbell message must fit PIPE_BUF to be written atomically")
        # O_RDWR on a FIFO never blocks at open and never sees end-of-file (Linux).
        self.fd = os.open(path, os.O_RDWR)

    @staticmethod
    def create(path: str) -> str:
        if os.path.exists(path):
            os.unlink(path)
        os.mkfifo(path, 0o600)
        return path

    def ring(self, msg: Message) -> None:
        os.write(self.fd, self.struct.pack(*msg))  # <= PIPE_BUF bytes: one atomic write

    def wait(self, check: Callable[[], None] | None = None, poll_s: float = 0.05) -> Message:
        """The next message; ``check`` runs every ``poll_s`` while none comes (it raises to
        give up, e.g. when the peer's Ray call has failed)."""
        need, buf = self.struct.size, b""
        while len(buf) < need:
            ready, _, _ = select.select([self.fd], [], [], poll_s)
            if not ready:
                if check is not None:
                    check()
                continue
            buf += os.read(self.fd, need - len(buf))
        return self.message(*self.struct.unpack(buf))

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def wait_all(
    bell: Doorbell[Message],
    count: int,
    check: Callable[[], None],
    timeout_s: float | None = None,
) -> list[Message]:
    """``count`` messages from one doorbell, in arrival order."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def guarded() -> None:
        check()
        if deadline is not None and time.monotonic() > deadline:
            raise DoorbellTimeout(f"no answer on {bell.path} within {timeout_s} s")

    return [bell.wait(guarded) for _ in range(count)]


class Steps:
    """A role's side of a chunk of steps rung through doorbells (:class:`.protocol.Wiring`):
    :meth:`wait` before each step, :meth:`done` after it, :meth:`close` at the end."""

    def __init__(self, wiring: Wiring, done: type[Message], check: Callable[[], None]) -> None:
        self.wiring, self.check = wiring, check
        self.go = Doorbell(wiring.go, Go)
        self.done_bell = Doorbell(wiring.done, done) if wiring.done else None
        self.then = [Doorbell(path, Go) for path in wiring.then]

    def run(
        self,
        start: int,
        stop: int,
        step_fn: Callable[[int], tuple[Any, Message]],
        failed: Message,
        after: Callable[[], None] | None = None,
    ) -> list[Any]:
        """Steps ``start .. stop-1``: each waited for, run (``step_fn`` gives what the step
        measured and the done message), and rung as done, then ``after`` called (the role's
        own bookkeeping of the step, off the path its peers wait on); what each measured.
        Where a step raises, ``failed`` is rung first. The doorbells are closed at the end."""
        out = []
        try:
            for step in range(start, stop):
                self.wait(step)
                record, msg = step_fn(step)
                out.append(record)
                self.done(msg, step, stop)
                if after is not None:
                    after()
        except BaseException:
            self.failed(failed)
            raise
        finally:
            self.close()
        return out

    def wait(self, step: int) -> None:
        """Until ``n_go`` go messages for ``step`` have come (one of another chunk, left by a
        chunk that failed, is dropped). ``check`` runs first: told to stop, a role whose
        peers keep ringing stops at the next step all the same."""
        self.check()
        heard = 0
        while heard < self.wiring.n_go:
            msg = self.go.wait(self.check)
            if msg.chunk != self.wiring.chunk:
                continue
            if msg.step != step:
                raise RuntimeError(f"rung for step {msg.step}, expected {step}")
            heard += 1

    def done(self, msg: Message, step: int, stop: int) -> None:
        """Ring ``msg`` on the done doorbell, if any, then, where the next step is in this
        chunk, the ``then`` doorbells."""
        if self.done_bell is not None:
            self.done_bell.ring(msg)
        nxt = step + self.wiring.next_step
        if nxt < stop:
            go = Go(nxt, self.wiring.chunk)
            for bell in self.then:
                bell.ring(go)

    def failed(self, msg: Message) -> None:
        """Ring ``msg`` (a failure) on the done doorbell, if any: the stub learns of it at
        once (without one, from the role's call)."""
        if self.done_bell is not None:
            self.done_bell.ring(msg)

    def close(self) -> None:
        for bell in (self.go, self.done_bell, *self.then):
            if bell is not None:
                bell.close()


class ServeAborted(RuntimeError):
    """A serve loop was told to stop waiting: its stub, or a peer of its group, is gone."""


class Abortable:
    """A role whose serve loop can be stopped from outside while it waits for the stub.

    A role runs its calls one at a time, so while ``serve`` waits on a doorbell nothing else
    reaches it. :meth:`abort` runs in the actor's ``control`` concurrency group, beside that
    call: the loop notices within one poll of its doorbell and ends with :class:`ServeAborted`.
    :meth:`clear_abort` runs in the default group, so it returns only once the loop has ended.
    """

    def _abort_flag(self) -> threading.Event:
        flag = self.__dict__.get("_abort")
        if flag is None:
            flag = self.__dict__.setdefault("_abort", threading.Event())
        return flag

    def abort(self) -> None:
        self._abort_flag().set()

    def clear_abort(self) -> None:
        self._abort_flag().clear()

    def check_abort(self) -> None:
        """The ``check`` of a doorbell wait in a serve loop."""
        if self._abort_flag().is_set():
            raise ServeAborted("serving aborted: the stub or a peer of the group was lost")

    def fetched(self, sources: tuple) -> tuple:
        """``sources`` with each server's published values (:class:`.protocol.Published`)
        fetched here, abortably (:meth:`fetch`)."""
        wanted = [s.ref for s in sources if isinstance(s, Published)]
        if not wanted:
            return sources
        got = iter(self.fetch(wanted))
        return tuple(next(got) if isinstance(s, Published) else s for s in sources)

    def fetch(self, refs: list[Any]) -> list[Any]:
        """``ray.get`` of ``refs`` (objects another role made), looking for an abort while
        they are not all here: a call that waits for an object whose maker's host went
        silent ends when the driver's recovery aborts it, and later calls are not held."""
        import ray  # noqa: PLC0415

        while len(ray.wait(refs, num_returns=len(refs), timeout=FETCH_POLL_S)[0]) < len(refs):
            self.check_abort()
        return ray.get(refs)


FETCH_POLL_S = 0.05  # how often a role waiting for objects looks for an abort
