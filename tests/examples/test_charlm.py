"""examples/charlm.yaml, the GPT-style language model, at a small scale (a part of the corpus,
a few steps): a SIGKILLed driver resumed, and a lost worker, each end bit-identical to a run
never interrupted."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import params_of, sigkill_once, signal_worker_at, start_ray

from raysinga import config
from raysinga.checkpoint import steps
from raysinga.distributed import DistributedTrainer

JOB = Path(__file__).resolve().parents[2] / "examples" / "charlm.yaml"
SMALL = [
    "train_steps=12",
    "checkpoint_frequency=4",
    "disp_freq=1",
    "test_freq=0",
    "data.source.max_chars=300000",
    "data.source.valid_every=10",
]


def small(run_dir: Path, *more: str) -> config.JobConfig:
    return config.load(JOB, [*SMALL, f"run_dir={run_dir}", *more])


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, dict]:
    """The small job on Ray, never interrupted: its run directory and final parameters."""
    start_ray()  # the session's embedded Ray (``ray_session`` is per test)
    run = tmp_path_factory.mktemp("charlm") / "straight"
    return run, DistributedTrainer(small(run), log=None).fit().params


@pytest.mark.slow
def test_the_example_resumes_bit_identically_after_a_sigkill(ray_session, straight, tmp_path):
    want = params_of(straight[0] / "checkpoints" / "step-12")
    run = tmp_path / "killed"
    address = ray_session.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "raysinga.cli", "train", str(JOB), "--address", address]
    cmd += [x for s in [*SMALL, f"run_dir={run}"] for x in ("--set", s)]
    sigkill_once(cmd, run / "checkpoints" / "step-4", timeout_s=300)
    assert steps(run / "checkpoints")[0] < 12
    r = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bits per character; unigram baseline" in r.stdout, r.stdout
    assert params_of(run / "checkpoints" / "step-12") == want


@pytest.mark.slow
def test_the_example_survives_a_lost_worker_bit_identically(ray_session, straight, tmp_path):
    want = straight[1]
    t = DistributedTrainer(small(tmp_path / "lost"), log=None)
    fired = signal_worker_at(t, 6, signal.SIGKILL)
    got = t.fit().params
    assert fired, "the kill never fired"
    for k, a in want.items():
        assert got[k].tobytes() == a.tobytes(), k
    lines = (tmp_path / "lost" / "metrics.jsonl").read_text()
    assert '"kind": "failure"' in lines and '"role": "worker"' in lines
