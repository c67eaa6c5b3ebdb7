"""A role that stops answering without dying (its process stopped with SIGSTOP: a hung call,
a machine cut off) is noticed by the run's heartbeat (raysinga/distributed/silence.py): taken
as lost once silent for ``fault.silent_s`` on a node that answers, killed, replaced, and the
run ends bit-identical to one never interrupted; so too while the run takes a checkpoint
(Ray would never give a stopped process up)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest
import ray
from helpers import load_job, signal_worker_at

from raysinga.distributed import DistributedTrainer
from raysinga.distributed.silence import Silent, Watch
from raysinga.obs.events import TrainStep

JOB = """
name: silence
seed: 12
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 32, activation: relu}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 32}
updater: {name: sgd, lr: 0.05, momentum: 0.9}
train_steps: 60
disp_freq: 5
test_freq: 0
topology: {preset: sandblaster, n_servers: 1, workers_per_group: 2}
fault: {silent_s: 1.0, silent_steps: 1}
"""


@pytest.mark.slow
def test_a_stopped_worker_is_taken_as_lost_and_replaced_bit_exact(ray_session, tmp_path):
    straight = DistributedTrainer(load_job(tmp_path / "a", JOB), log=None).fit()
    lines: list[str] = []
    t = DistributedTrainer(load_job(tmp_path / "b", JOB), log=lines.append)
    stopped = signal_worker_at(t, 20, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        res = t.fit()
    finally:
        for pid in stopped:  # Ray's SIGKILL ends a stopped process too; in case it did not
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert stopped, "the stop never fired"
    text = "\n".join(lines)
    assert "worker 1 of group 0 was lost: silent: no answer for 1.0 s" in text, text
    assert "recovered in" in text and "unreachable" not in text, text
    assert time.monotonic() - t0 < 60
    for k, a in straight.params.items():
        assert res.params[k].tobytes() == a.tobytes(), k
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{stopped[0]}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{stopped[0]}"), "the silent worker was killed"


@pytest.mark.slow
def test_a_server_stopped_as_a_checkpoint_begins_is_taken_as_lost_and_rebuilt_bit_exact(
    ray_session, tmp_path
):
    """The checkpoint's calls to the servers wait listening to the roles, as a chunk does:
    they waited on the stopped server for ever."""
    more = ("checkpoint_frequency=20", "fault.max_failures=3")
    straight = DistributedTrainer(load_job(tmp_path / "a", JOB, *more), log=None).fit()
    lines: list[str] = []
    t = DistributedTrainer(load_job(tmp_path / "b", JOB, *more), log=lines.append)
    stopped: list[int] = []

    def stop_the_server(ev) -> None:  # before the checkpoint of step 20 asks the servers
        if not stopped and isinstance(ev, TrainStep) and ev.step == 20:
            stopped.append(ray.get(t.servers[0].pid.remote()))
            os.kill(stopped[0], signal.SIGSTOP)

    t.hub.subscribe(stop_the_server)
    try:
        res = t.fit()
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    text = "\n".join(lines)
    assert stopped, text
    assert "server 0 was lost: silent: no answer for 1.0 s" in text, text
    assert "recovered in" in text and "restarting" not in text, text
    for k, a in straight.params.items():
        assert res.params[k].tobytes() == a.tobytes(), k


def quiet():
    """A role that answers the heartbeat until hushed (then never in time), with a call of a
    given length. (Defined here: Ray's workers cannot import the test module, and take the
    class by value.)"""

    @ray.remote(concurrency_groups={"control": 1}, max_concurrency=2)
    class Quiet:
        def __init__(self) -> None:
            self.stall = threading.Event()

        def alive(self) -> tuple[int, int]:
            if self.stall.is_set():
                time.sleep(30)
            return 1, 0

        def call(self, s: float) -> float:
            time.sleep(s)
            return s

        def hush(self) -> None:
            self.stall.set()

    return Quiet.remote()


def test_the_watch_takes_a_role_silent_only_past_both_limits(ray_session):
    from types import SimpleNamespace

    from raysinga.distributed.silence import Role

    q = quiet()
    ray.get(q.alive.remote())  # up
    fault = SimpleNamespace(unreachable_s=0.2, silent_s=1.0, silent_steps=10)
    watch = Watch(fault)
    here = ray.get_runtime_context().get_node_id()
    watch.arm([Role(q, "worker", 0, 0, here)])
    watch.step_s = 0.2  # 10 steps of it: 2 s, past silent_s
    for _ in range(3):  # heartbeats sent and answered
        assert watch.check() == []
        time.sleep(0.1)
    ray.get(q.hush.remote())
    t0 = time.monotonic()
    caught = None
    while time.monotonic() - t0 < 10 and caught is None:
        try:
            time.sleep(0.1)
            watch.check()
        except Silent as e:
            caught = e
    assert caught is not None and caught.nodes == {}, "its node answers: the role alone"
    # not at silent_s (1 s): only once 10 steps of 0.2 s went by too (a heartbeat sent just
    # before the hush counts from when it was sent)
    assert 1.5 <= time.monotonic() - t0 < 10, time.monotonic() - t0
    assert "no answer for 2.0 s (10 steps of 200 ms)" in str(caught)
    ray.kill(q)


def test_a_wait_between_chunks_raises_for_a_role_gone_silent_while_a_call_hangs(ray_session):
    """:meth:`Watch.wait` (a checkpoint's calls): a role that stops answering raises
    :class:`Silent` once past the limits; calls that end return."""

    from types import SimpleNamespace

    from raysinga.distributed.silence import Role

    h = quiet()
    ray.get(h.alive.remote())
    watch = Watch(SimpleNamespace(unreachable_s=0.2, silent_s=0.6, silent_steps=1))
    watch.arm([Role(h, "server", 0, None, ray.get_runtime_context().get_node_id())])
    heard: list[str] = []
    watch.wait([h.call.remote(0.5)], heard.append)  # answered all along: it returns
    ray.get(h.hush.remote())
    t0 = time.monotonic()
    with pytest.raises(Silent, match="no answer for 0.6 s"):
        watch.wait([h.call.remote(30)], heard.append)
    assert time.monotonic() - t0 < 10 and heard == []
    ray.kill(h)
