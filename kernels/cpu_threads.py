"""Element-wise and row-wise NumPy ops over several threads: NumPy's ufuncs release the GIL but
run on one core, where BLAS and PyTorch use all the cores they are given.

An op splits its rows into one contiguous range per thread and each thread writes its own range
of a preallocated output, so the result is the same bits however many threads run it. The
thread count follows ``OMP_NUM_THREADS`` (which Ray sets for each actor to the CPUs it holds,
as it does for BLAS), else the cores this process may use.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

MIN_PER_THREAD = 1 << 16  # elements: below this a thread costs more than it saves

# OpenBLAS's idle threads spin for 2^28 cycles (about 0.1 s) after each GEMM, holding the cores
# the element-wise ops that follow want; 2^20 cycles (about 0.4 ms) still bridges back-to-back
# GEMMs. OpenBLAS reads this once, as it loads, so it belongs in a process's environment from
# its start: the embedded Ray's processes get it (actors.cluster.connect), a cluster's nodes
# from the environment of `ray start`. On 2 cores it made the example language model's step
# 12% to 19% faster in A/B runs (benchmarks/bench_step.py --model charlm).
BLAS_ENV = {"OPENBLAS_THREAD_TIMEOUT": "20"}


def compute_threads(cpus: float) -> int:
    """The BLAS threads of a process computing gradients on ``cpus`` CPUs (a worker's share of
    the topology; the single-process run of a job with a topology uses its workers' share)."""
    return max(1, int(cpus))


def blas_threads(n: int | None):
    """``threadpoolctl``'s limit of every loaded BLAS to ``n`` threads (None: as they are).

    A matrix product's bits depend on the BLAS's thread count (OpenBLAS blocks the inner sum
    differently with more threads), so processes that must agree bit for bit (a one-worker
    group and the single-process run of the same job) run their BLAS on the same count. As a
    context manager it restores the earlier limits on exit; called alone it holds for the
    process (a worker's)."""
    from threadpoolctl import threadpool_limits  # noqa: PLC0415 - loads the BLAS's info

    return threadpool_limits(limits=n, user_api="blas")


_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def threads() -> int:
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def over_rows(fn: Callable[[int, int], None], rows: int, elements: int) -> None:
    """``fn(lo, hi)`` for ranges of ``rows`` covering them all, in threads where ``elements``
    (the work) is large enough; returns once every range is done (raising the first error)."""
    global _pool, _pool_size
    n = min(threads(), rows, max(1, elements // MIN_PER_THREAD))
    if n <= 1:
        fn(0, rows)
        return
    if _pool is None or _pool_size < n - 1:
        _pool = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="raysinga-ops")
        _pool_size = n - 1
    bounds = [rows * k // n for k in range(n + 1)]
    futures = [_pool.submit(fn, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True)]
    try:
        fn(bounds[0], bounds[1])  # this thread takes the first range: one hand-off fewer
    finally:
        wait(futures)  # no range may still be writing once this returns, error or not
    for f in futures:
        f.result()
