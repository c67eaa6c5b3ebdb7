"""What the parts of a split layer hand one another (:mod:`raysinga.nn.partition`) when they
are workers of one group on one host: each part's array through a slot of a shared-memory
file, each part's progress through two counters a futex waits on (:mod:`..common.seqwait`).

One file holds, for each of the ``k`` parts, a slot of ``capacity`` bytes, a counter of the
exchanges it has written and one of those it has read. The ``c``-th exchange: a part waits
until every part has read exchange ``c - 1`` (its slot may then be written again), writes its
array into its slot, sets its written counter to ``c`` and wakes the others; waits until
every part has written ``c``; reads the slots in part order (their sum, or their
concatenation: the same bits on every part); sets its read counter to ``c``. Every part makes
the same exchanges in the same order with arrays of the same shape and dtype. A wait calls
``check`` between sleeps (it raises to give up: a part lost, the run stopping) and gives up
after ``timeout_s``.

A counter is written after its slot; on the x86-64 machines this runs on, another core sees
the two stores in that order (total store order).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from raysinga.optim.grads import sum_into

from ..common.buffers import Attachments, Layout, SharedBuffer, ShmHandle
from ..common.seqwait import sleep_while, wake

SLEEP_S = 0.05  # a wait's longest sleep between checks


class PartsTimeout(RuntimeError):
    """A part waited longer than its timeout for the others."""


def layout(parts: int, capacity: int) -> Layout:
    """The file of ``parts`` slots of ``capacity`` bytes and their counters."""
    arrays: dict[str, tuple[tuple[int, ...], str]] = {
        "written": ((parts,), "int64"),
        "read": ((parts,), "int64"),
    }
    arrays.update({f"slot{p}": ((capacity,), "uint8") for p in range(parts)})
    return Layout.of(arrays)


def create(tag: str, parts: int, capacity: int) -> SharedBuffer:
    """The file, made by the role that owns the partition's lifetime (counters at 0)."""
    return SharedBuffer(f"{tag}-parts", layout(parts, capacity))


class PartsExchange:
    """Part ``part`` of ``parts``' side of the exchanges in the file ``handle`` names (an
    :class:`raysinga.nn.partition.Exchange`)."""

    def __init__(
        self,
        handle: ShmHandle,
        parts: int,
        part: int,
        check: Callable[[], None] = lambda: None,
        timeout_s: float = 60.0,
    ) -> None:
        if not 0 <= part < parts:
            raise ValueError(f"part {part} of {parts} does not exist")
        self.parts, self.part, self.check, self.timeout_s = parts, part, check, timeout_s
        self._maps = Attachments(writable=True)
        views = self._maps.views(handle)
        self.written, self.read = views["written"], views["read"]
        self.slots = [views[f"slot{p}"] for p in range(parts)]
        self.capacity = self.slots[0].size
        self.count = int(self.written[part])  # exchanges made (a replacement goes on from here)

    def sum(self, x: Any) -> Any:
        return self._swap(x, _added)  # in part order

    def gather(self, x: Any, axis: int) -> Any:
        return self._swap(x, lambda xs: np.concatenate(xs, axis=axis))

    def close(self) -> None:
        self.slots = []
        self._maps.close()

    def _swap(self, x: Any, combine: Callable[[list[np.ndarray]], np.ndarray]) -> np.ndarray:
        a = np.ascontiguousarray(x)
        if a.nbytes > self.capacity:
            raise ValueError(
                f"an array of {a.nbytes} bytes does not fit the partition's slots of "
                f"{self.capacity} bytes"
            )
        c = self.count + 1
        deadline = time.monotonic() + self.timeout_s
        for q in range(self.parts):  # every part is done reading exchange c - 1
            self._wait(self.read, q, c - 1, deadline)
        self.slots[self.part][: a.nbytes] = a.reshape(-1).view(np.uint8)
        self._set(self.written, c)
        for q in range(self.parts):
            self._wait(self.written, q, c, deadline)
        xs = [s[: a.nbytes].view(a.dtype).reshape(a.shape) for s in self.slots]
        out = combine(xs)  # a new array: read out before the slots may be written again
        self._set(self.read, c)
        self.count = c
        return out

    def _set(self, counters: np.ndarray, value: int) -> None:
        word = counters[self.part : self.part + 1]
        word[0] = value
        wake(word)

    def _wait(self, counters: np.ndarray, q: int, value: int, deadline: float) -> None:
        word = counters[q : q + 1]
        while True:
            now = int(word[0])
            if now >= value:
                return
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                what = "written" if counters is self.written else "read"
                raise PartsTimeout(
                    f"part {self.part}: part {q} has not {what} exchange {value} within "
                    f"{self.timeout_s} s"
                )
            sleep_while(word, now, min(SLEEP_S, left))


def _added(xs: list[np.ndarray]) -> np.ndarray:
    """The arrays added in the given order, into a new one."""
    out = np.empty_like(xs[0])
    sum_into(out, xs)
    return out
