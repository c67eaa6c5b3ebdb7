"""Waiting for a counter in shared memory to reach a value, asleep: a Linux futex on the
counter's word, shared between processes that map the same file.

A worker of a group summed by hosts (``topology.reduce: hosts``) is handed its step before the
servers' values it reads are in (:func:`.stub_side.block_steps`); it waits for the counter of
its node's mirror of each server (:mod:`.mirrors`) or of a server beside it
(:class:`.buffers.UpdateGuard`). A loop that looks every half millisecond costs the cores
that the step's own work needs (four such loops measured no faster than no step sent ahead, on
two cores); a futex sleeps in the kernel until the writer wakes it, microseconds after the
counter moves. Where there are no futexes (not Linux, or an unknown machine), the wait sleeps
:data:`FALLBACK_S` at a time.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import time

import numpy as np

FALLBACK_S = 0.0005
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared between processes: not FUTEX_PRIVATE_FLAG
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None:
        return None
    fn = ctypes.CDLL(None, use_errno=True).syscall  # CDLL: the call releases the GIL
    fn.restype = ctypes.c_long
    return fn


_CALL = _syscall()


def _word(counter: np.ndarray) -> ctypes.c_void_p:
    """The address of the low 32 bits of ``counter[0]`` (a little-endian int64 in a shared
    mapping; the futex compares those bits)."""
    if counter.dtype != np.int64 or counter.ctypes.data % 8:
        raise ValueError("a futex counter is an aligned int64")
    return ctypes.c_void_p(counter.ctypes.data)


def sleep_while(counter: np.ndarray, value: int, seconds: float) -> None:
    """Sleep while ``counter[0]`` still holds ``value`` (read just before), at most
    ``seconds``; returns at once where it holds something else already, and on a wake from
    :func:`wake` or a signal. The caller reads the counter again after."""
    if _CALL is None:
        time.sleep(min(seconds, FALLBACK_S))
        return
    ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    low = ctypes.c_uint32(value & 0xFFFFFFFF)
    _CALL(_SYS_FUTEX, _word(counter), _FUTEX_WAIT, low, ctypes.byref(ts), None, 0)


def wake(counter: np.ndarray) -> None:
    """Wake every process asleep on ``counter`` (:func:`sleep_while`), after it changed."""
    if _CALL is not None:
        _CALL(_SYS_FUTEX, _word(counter), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
