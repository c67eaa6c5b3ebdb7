"""Errors that name the role: a lost process is named as the one whose call died, not as one
whose call was still running beside it."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from ray import cloudpickle

from raysinga.actors.errors import ActorLost, get_all


class Sleeper:
    def pid(self) -> int:
        return os.getpid()

    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # its workers cannot import tests


@pytest.mark.parametrize("lost", [0, 1])
def test_the_role_named_lost_is_the_one_that_died(ray_session, lost):
    ray = ray_session
    actors = [ray.remote(Sleeper).options(num_cpus=0).remote() for _ in range(2)]
    pids = ray.get([a.pid.remote() for a in actors])
    naps = [a.nap.remote(3.0) for a in actors]  # both still running when one dies
    os.kill(pids[lost], signal.SIGKILL)
    with pytest.raises(ActorLost) as e:
        get_all(naps, "server", None, None, [5, 7])
    assert (e.value.role, e.value.index) == ("server", [5, 7][lost])
    for a in actors:
        ray.kill(a)
