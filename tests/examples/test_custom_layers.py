"""examples/custom_layers/: the language model with layers of the user's own (RMSNorm and
SwiGLU in the example's own module), named by import path and shipped with the job, trains on
one process and on Ray from a working directory that is not the example's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parents[2] / "examples" / "custom_layers" / "charlm.yaml"
SMALL = [
    "train_steps=4",
    "disp_freq=2",
    "test_freq=0",
    "data.source.max_chars=200000",
    "data.source.valid_every=10",
]


def train(run_dir: Path, *more: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "raysinga.cli", "train", str(JOB), *more]
    cmd += [x for s in [*SMALL, f"run_dir={run_dir}"] for x in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": ""}  # the example's module comes with the job alone
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=run_dir.parent, env=env
    )


def test_the_example_trains_on_one_process(tmp_path):
    r = train(tmp_path / "local", "--local")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bits per character" in r.stdout, r.stdout


@pytest.mark.slow
def test_the_example_trains_on_ray_with_its_module_shipped(tmp_path):
    r = train(tmp_path / "ray", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "started an embedded local Ray" in r.stdout and "bits per character" in r.stdout
