"""Run a worker's steps as a batch thread, so that waking it never preempts the role ringing it.

Each step, a server (or the group's stub) rings the group's workers one after another through
their doorbells (FIFOs). Linux treats a wakee that has slept as interactive: woken on the core
of the ringer, it preempts the ringer at once, and the ringer's next ring waits for the end of
that worker's time slice, while the other worker's core idles. Measured here
(``benchmarks/bench_wakeup.py``: plain processes on 2 cores, one ringing two workers pinned to a
core each, 600 rings a round, 3 rounds), the second worker started more than 1 ms late in 161
of the 600 rings (median; 85 to 327), and as batch threads in 5 (1 to 7).

``SCHED_BATCH`` keeps the thread's share of the CPU (its nice value is unchanged) and takes away
only that preemption on wake-up: the ringer rings every worker, then sleeps, and the workers run.
It is the policy Linux documents for CPU-bound, non-interactive work, which a worker's step is,
and any user may set it. On the distributed benchmark (``bench_distributed.py``, 10 alternating
pairs of one-round runs, 2 cores), the time from the server's ring to the slower worker's start
went from 0.43 ms a step to 0.30 (medians; lower in 8 of the 10 pairs, equal in one).

:func:`batch_scheduling` sets it for the calling thread (a worker's serving thread, and the
threads it starts later); it does nothing where the platform has no such policy or refuses it.
"""

from __future__ import annotations

import os


def batch_scheduling() -> bool:
    """Make the calling thread ``SCHED_BATCH``. True where it took."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:  # refused (a seccomp profile): the default policy stays
        return False
    return True
