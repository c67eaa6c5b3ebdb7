"""A stub that comes back after it was cut off, for the partition test (test_partition.py),
and the driver that trains with it on an emulated host.

A stub whose host is partitioned is replaced; once the link is back, the old one may act
before Ray reaches it to end it. Whether it does depends on races between TCP's
retransmissions and Ray's kill. :class:`ReturningStub` makes it certain: it watches its link
itself (a TCP connection to the head, which a host that is up answers from its kernel). Once
the head has not answered while no chunk of steps moved for a while (it is cut off), it waits
for the head to answer again and then sends each server the update of the step it last
started, again and again, until its process ends (for :data:`RETURN_S` at most). The sends
leave only once the link is back, over connections that hold nothing from the partition, so
they reach the servers before Ray's kill reaches the stub (that waits on retransmissions backed
off through the partition); the run's epoch must refuse them.
"""

from __future__ import annotations

import threading
import time

import ray

from raysinga.actors.stub import Stub
from raysinga.cluster.connect import host_answers

QUIET_S = 5.0  # no chunk began or ended for this long (chunks take about a second) ...
PROBE_S = 0.5  # ... and the head did not answer a connection within this: cut off
RETURN_S = 300.0  # how long it waits for the link, and then sends, at most


class ReturningStub(Stub):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._start = -1  # the first step of the chunk begun last
        self._moved = time.monotonic()  # when a chunk last began or ended
        host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
        self._head = (host, int(port))
        threading.Thread(target=self._return, daemon=True).start()

    def run(self, start: int, stop: int):
        self._start, self._moved = start, time.monotonic()
        try:
            return super().run(start, stop)
        finally:
            self._moved = time.monotonic()

    def _return(self) -> None:
        while True:  # until the process ends (a daemon thread), or it has returned
            time.sleep(0.25)
            quiet = time.monotonic() - self._moved >= QUIET_S
            if self._start < 0 or not quiet or host_answers(self._head, PROBE_S):
                continue
            deadline = time.monotonic() + RETURN_S
            while not host_answers(self._head, PROBE_S):  # cut off: wait for the link
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
            step, deadline = self._start, time.monotonic() + RETURN_S
            while time.monotonic() < deadline:
                for k, server in enumerate(self.servers):
                    server.update.remote(step, self._update_arg(k), self.group, self.epoch)
                time.sleep(0.25)
            return


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
