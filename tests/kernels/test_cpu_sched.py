"""A worker's serving thread as a batch thread (kernels/cpu_sched.py)."""

from __future__ import annotations

import os
import threading

import pytest

from raysinga.kernels.cpu_sched import batch_scheduling


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_the_calling_thread_alone_becomes_a_batch_thread():
    seen: dict[str, int] = {}

    def serve() -> None:
        seen["before"] = os.sched_getscheduler(0)
        seen["took"] = batch_scheduling()
        seen["after"] = os.sched_getscheduler(0)
        t = threading.Thread(target=lambda: seen.update(child=os.sched_getscheduler(0)))
        t.start()
        t.join()

    main = os.sched_getscheduler(0)
    t = threading.Thread(target=serve)
    t.start()
    t.join()
    assert seen == {
        "before": main,
        "took": True,
        "after": os.SCHED_BATCH,
        "child": os.SCHED_BATCH,  # threads it starts later inherit it
    }
    assert os.sched_getscheduler(0) == main  # the process's other threads keep theirs
