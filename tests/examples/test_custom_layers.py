"""examples/custom_layers/: the language model with layers of the user's own (RMSNorm and
SwiGLU in the example's own module), named by import path and shipped with the job. It trains
on one process and on Ray from a working directory that is not the example's; a SIGKILLed
driver resumed, and a lost worker, each end bit-identical to a run never interrupted.
(tests/cluster/test_submit.py runs it on hosts that have neither raysinga nor the module.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import params_of, sigkill_once, signal_worker_at

from raysinga import config
from raysinga.checkpoint import steps
from raysinga.distributed import DistributedTrainer

JOB = Path(__file__).resolve().parents[2] / "examples" / "custom_layers" / "charlm.yaml"
SMALL = [
    "train_steps=8",
    "checkpoint_frequency=4",
    "disp_freq=2",
    "test_freq=0",
    "data.source.max_chars=200000",
    "data.source.valid_every=10",
]


def command(run_dir: Path, *more: str) -> list[str]:
    cmd = [sys.executable, "-m", "raysinga.cli", "train", str(JOB), *more]
    return cmd + [x for s in [*SMALL, f"run_dir={run_dir}"] for x in ("--set", s)]


def train(run_dir: Path, *more: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ""}  # the example's module comes with the job alone
    return subprocess.run(
        command(run_dir, *more),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=run_dir.parent,
        env=env,
    )


def small(run_dir: Path) -> config.JobConfig:
    return config.load(JOB, [*SMALL, f"run_dir={run_dir}"])


def test_the_example_trains_on_one_process(tmp_path):
    r = train(tmp_path / "local", "--local")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bits per character" in r.stdout, r.stdout


@pytest.mark.slow
def test_the_example_trains_on_ray_with_its_module_shipped(tmp_path):
    r = train(tmp_path / "ray", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "started an embedded local Ray" in r.stdout and "bits per character" in r.stdout


@pytest.mark.slow
def test_the_example_resumes_bit_identically_after_a_sigkill(ray_session, tmp_path):
    DistributedTrainer(small(tmp_path / "straight"), log=None).fit()
    want = params_of(tmp_path / "straight" / "checkpoints" / "step-8")
    run = tmp_path / "killed"
    address = ray_session.get_runtime_context().gcs_address
    cmd = command(run, "--address", address)
    sigkill_once(cmd, run / "checkpoints" / "step-4", timeout_s=300)
    assert steps(run / "checkpoints")[0] < 8
    r = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert params_of(run / "checkpoints" / "step-8") == want


@pytest.mark.slow
def test_the_example_survives_a_lost_worker_bit_identically(ray_session, tmp_path):
    want = DistributedTrainer(small(tmp_path / "straight"), log=None).fit().params
    t = DistributedTrainer(small(tmp_path / "lost"), log=None)
    fired = signal_worker_at(t, 4, signal.SIGKILL)  # a report (disp_freq 2), mid-run
    got = t.fit().params
    assert fired, "the kill never fired"
    for k, a in want.items():
        assert got[k].tobytes() == a.tobytes(), k
    lines = (tmp_path / "lost" / "metrics.jsonl").read_text()
    assert '"kind": "failure"' in lines and '"role": "worker"' in lines


def test_a_node_that_cannot_import_the_jobs_module_is_one_line(ray_session, tmp_path):
    """Not shipped (``--no-ship``), in a Ray that other code started: the session's nodes
    have raysinga but not the example's module, and the run stops before any role with one
    line naming the node, the module and what to do."""
    from raysinga.cluster.shipping import NodeSetupError

    with pytest.raises(NodeSetupError) as e:
        DistributedTrainer(small(tmp_path / "unshipped"), log=None, ship=False).fit()
    line = str(e.value)
    assert "\n" not in line
    assert "cannot import mylayers" in line and "No module named 'mylayers'" in line, line
    assert "the job's `modules` names it" in line and "py_modules" in line, line
    assert not (tmp_path / "unshipped" / "checkpoints").exists()
