"""Chaos: role processes SIGKILLed at seeded random instants, found through Ray's own state,
some of them while the driver recovers from the kill before; the run ends bit-identical."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from helpers import load_job

from raysinga import config
from raysinga.checkpoint import Checkpoint
from raysinga.distributed import DistributedTrainer
from raysinga.distributed.chaos import RECOVERY_STATES, Chaos
from raysinga.obs.events import TrainStep
from raysinga.run.session import Preempted

JOB = """
name: chaos
seed: 5
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 32, activation: relu}
    - {kind: dropout, name: drop, rate: 0.1}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 32}
updater: {name: adam, lr: 0.01}
train_steps: 800
disp_freq: 10
test_freq: 0
checkpoint_frequency: 50
topology: {preset: sandblaster, n_servers: 2, workers_per_group: 2}
"""


def job(d: Path, *more: str) -> config.JobConfig:
    return load_job(d, JOB, "fault.max_failures=20", *more)


def run_under_chaos(
    d: Path, seed: int, kills: int, aimed: int, gap: tuple[float, float], *more, **nodes
):
    """The job under chaos, stopped (as by SIGTERM: a checkpoint at the step reached) once
    the last kill is recovered and a step trained after it; then an uninterrupted run of the
    job to that step, whose every parameter the chaos run's checkpoint holds bit for bit
    (``train_steps`` in ``more`` then only bounds the chaos run). A run that reaches its last
    step first is held to an uninterrupted run of the whole job."""
    t = DistributedTrainer(job(d / "chaos", *more), log=None)
    lines: list[str] = []
    chaos = Chaos(t, seed, kills, gap, aimed, lines.append, **nodes)
    seen: list[int] = []  # the recoveries counted when the last kill was seen

    def stop_once_survived(ev) -> None:
        if not isinstance(ev, TrainStep) or len(chaos.done) < kills:
            return
        if not seen:
            seen.append(len(chaos.failures))
        elif len(chaos.failures) > seen[0] and t.session.stop_signal is None:
            t.session.stop_signal = signal.SIGTERM

    t.hub.subscribe(stop_once_survived)
    to = list(more)
    with chaos:
        try:
            got = t.fit().params  # it ran to its last step first
        except Preempted as e:
            assert e.path is not None, (e, lines)
            got = Checkpoint.open(e.path).arrays("param")
            to = [x for x in more if not x.startswith("train_steps=")] + [f"train_steps={e.step}"]
    want = DistributedTrainer(job(d / "straight", *to), log=None).fit().params
    assert sorted(got) == sorted(want), lines
    for k, a in want.items():
        assert got[k].tobytes() == a.tobytes(), (k, lines)
    return chaos, lines


@pytest.mark.slow
def test_twelve_kills_three_in_recoveries_are_survived_bit_exact(ray_session, tmp_path):
    chaos, lines = run_under_chaos(
        tmp_path, 11, 12, 3, (0.2, 1.5), "train_steps=10000", "fault.max_failures=40"
    )
    assert len(chaos.done) == 12, lines
    assert sum(k.aimed == "recovery" for k in chaos.done) == 3, lines
    assert any(k.state in RECOVERY_STATES for k in chaos.done), lines
    assert chaos.failures, lines
    report = chaos.report()
    assert report["seed"] == 11 and len(report["kills"]) == 12


def test_kills_aimed_at_recoveries_must_follow_another():
    with pytest.raises(ValueError, match="cannot be aimed"):
        Chaos(None, seed=0, kills=1, in_recovery=1)
