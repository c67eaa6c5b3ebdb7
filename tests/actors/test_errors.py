"""Errors that name the role: a lost process is named as the one whose call died, not as one
whose call was still running beside it."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from ray import cloudpickle

from raysinga.actors.common.errors import ActorLost, get_all, lost_server


class Sleeper:
    def pid(self) -> int:
        return os.getpid()

    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def publish(self) -> list:
        import ray

        return [ray.put(bytes(200_000))]  # owned by this actor, as a server's snapshot is

    def size(self, data: bytes) -> int:
        return len(data)

    def describe(self) -> dict:
        return {}


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


def test_an_argument_lost_with_its_owner_names_the_owner_lost(ray_session):
    """A worker given a server's published snapshot after the server died: the call fails
    with the object lost (a loss, not a bug of the worker), and the server is named."""
    from ray.exceptions import ObjectLostError

    ray = ray_session
    owner, reader = (ray.remote(Sleeper).options(num_cpus=0).remote() for _ in range(2))
    (snap,) = ray.get(owner.publish.remote())
    os.kill(ray.get(owner.pid.remote()), signal.SIGKILL)
    deadline = time.monotonic() + 30
    lost = None
    while lost is None and time.monotonic() < deadline:  # once Ray has seen the owner die
        try:
            get_all([reader.size.remote(snap)], "worker", 0)
            time.sleep(0.1)
        except ObjectLostError as e:
            lost = e
    assert lost is not None, "the argument outlived its owner"
    assert lost_server(lost, [reader, owner]) == 1
    assert lost_server(RuntimeError("a bug"), [reader, owner]) is None
    ray.kill(reader)
