"""A stub that comes back after it was cut off, for the partition test (test_partition.py),
and the driver that trains with it on an emulated host.

A stub whose host is partitioned is replaced; once the link is back, the old one may act
before Ray reaches it to end it. Whether it does depends on races between TCP's
retransmissions and Ray's kill. :class:`ReturningStub` makes it certain: once a chunk has
waited far longer than steps take (it is cut off), it sends each server the update of the
step it stands at, again and again, until its process ends. Messages it sent from across the
partition reach the servers when the link comes back; the run's epoch must refuse them.
"""

from __future__ import annotations

import threading
import time

from raysinga.actors.stub import Stub

CUT_OFF_S = 5.0  # a chunk held this long: the stub is cut off (chunks take about a second)


class ReturningStub(Stub):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._running: tuple[int, float] | None = None  # (first step, since) of the chunk
        threading.Thread(target=self._return, daemon=True).start()

    def run(self, start: int, stop: int):
        self._running = (start, time.monotonic())
        try:
            return super().run(start, stop)
        finally:
            self._running = None

    def _return(self) -> None:
        while True:
            time.sleep(0.25)
            running = self._running
            if running is None or time.monotonic() - running[1] < CUT_OFF_S:
                continue
            for k, server in enumerate(self.servers):
                server.update.remote(running[0], self._update_arg(k), self.group, self.epoch)


DRIVER = """
import sys
sys.path.insert(0, {tests!r})
from ray import cloudpickle
import returning
cloudpickle.register_pickle_by_value(returning)  # the roles' nodes cannot import tests
from raysinga import config
from raysinga.distributed import DistributedTrainer
cfg = config.load({job!r}, {sets!r})
DistributedTrainer(cfg, address={address!r}, classes={{"stub": returning.ReturningStub}}).fit()
print("final: done", flush=True)
"""
