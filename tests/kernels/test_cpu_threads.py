"""The CPU ops split over threads: the same bits for any thread count, and an error in one
range raised only once every range has stopped writing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from raysinga.kernels import cpu_seq, cpu_threads


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(cpu_threads, "MIN_PER_THREAD", 1)


def _ops(rng):
    x = rng.standard_normal((37, 24)).astype(np.float32)
    dy = rng.standard_normal((37, 24)).astype(np.float32)
    gamma = rng.standard_normal(24).astype(np.float32)
    beta = rng.standard_normal(24).astype(np.float32)
    scores = rng.standard_normal((5, 9, 9)).astype(np.float32)
    y, t = cpu_seq.gelu_forward(x)
    ln, mean, rstd = cpu_seq.layernorm_forward(x, gamma, beta, 1e-5)
    p = cpu_seq.causal_softmax_forward(scores, 0.3)
    return [
        y,
        t,
        cpu_seq.gelu_backward(dy, x, t),
        ln,
        mean,
        rstd,
        *cpu_seq.layernorm_backward(dy, x, gamma, mean, rstd),
        p,
        cpu_seq.causal_softmax_backward(scores, p, 0.3),
    ]


def test_the_bits_do_not_depend_on_the_thread_count(small_chunks, monkeypatch):
    results = {}
    for n in ("1", "2", "3", "8"):
        monkeypatch.setenv("OMP_NUM_THREADS", n)
        results[n] = _ops(np.random.default_rng(0))
    for n, arrays in results.items():
        for a, b in zip(results["1"], arrays, strict=True):
            assert a.tobytes() == b.tobytes(), f"{n} threads"


def test_every_range_is_covered_once(small_chunks, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    seen = []
    lock = threading.Lock()

    def fn(lo, hi):
        with lock:
            seen.append((lo, hi))

    cpu_threads.over_rows(fn, 10, 10)
    assert sorted(seen) == [(0, 3), (3, 6), (6, 10)]


def test_an_error_is_raised_after_the_other_ranges_finish(small_chunks, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    done = []

    def fn(lo, hi):
        if lo == 0:  # this thread's own range fails at once
            raise ValueError("range 0 failed")
        time.sleep(0.2)
        done.append(lo)

    with pytest.raises(ValueError, match="range 0 failed"):
        cpu_threads.over_rows(fn, 4, 4)
    assert done == [2]
