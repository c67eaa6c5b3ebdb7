"""examples/custom_layers/mylosses.py: a classifier's loss of the user's own, named in a job by
a string or with options, reports test accuracy and the final line as raysinga's own
classifying losses do, on one process and on Ray."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
from helpers import run_cli

from raysinga import cli

MYLOSSES = Path(__file__).resolve().parents[2] / "examples" / "custom_layers" / "mylosses.py"

JOB = """
name: smooth
seed: 1
modules: [{module}]
model:
  input_shape: [8]
  loss: {loss}
  layers:
    - {{kind: dense, name: fc1, units: 16, activation: relu}}
    - {{kind: dense, name: out, units: 3}}
data:
  source: {{kind: teacher, n: 512, dim: 8, num_classes: 3}}
  batch_size: 32
updater: {{name: sgd, lr: 0.1}}
train_steps: 40
disp_freq: 20
test_freq: 0
topology: {{preset: sandblaster, n_servers: 1, workers_per_group: 2}}
"""
SHORT = ["--set", "train_steps=10", "--set", "disp_freq=5", "--set", "checkpoint.final=false"]
FINAL = re.compile(r"^final test accuracy: (\d\.\d{4})$", re.M)


def job(d: Path, loss: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "job.yaml").write_text(JOB.format(module=MYLOSSES, loss=loss))
    return d / "job.yaml"


@pytest.mark.parametrize(
    "loss", ['"mylosses:smooth_ce"', '{kind: "mylosses:smooth_ce", smoothing: 0.2}']
)
def test_a_users_classifying_loss_reports_accuracy_on_one_process(tmp_path, loss):
    path = job(tmp_path / "job", loss)
    r = run_cli("train", str(path), "--local", "--set", f"run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "training 'smooth' on cpu" in r.stdout and FINAL.search(r.stdout), r.stdout


def test_a_users_classifying_loss_reports_accuracy_on_ray(ray_session, tmp_path):
    path = job(tmp_path / "job", '{kind: "mylosses:smooth_ce", smoothing: 0.2}')
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["train", str(path), *SHORT, "--set", f"run_dir={tmp_path / 'run'}"])
    shown = out.getvalue()
    assert code == 0, shown + err.getvalue()
    assert "training 'smooth' on Ray" in shown and FINAL.search(shown), shown
