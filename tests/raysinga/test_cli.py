"""The command line as a user runs it: a real subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def raysinga(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raysinga.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_train_prints_progress_and_final_accuracy(tmp_path):
    r = raysinga(
        "train",
        str(ROOT / "examples/digits_mlp.yaml"),
        "--set",
        "train_steps=60",
        "--set",
        "disp_freq=20",
        "--set",
        f"run_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "step 20/60" in r.stdout and "step 60/60  test_loss" in r.stdout
    assert "final test accuracy: 0." in r.stdout
    assert (tmp_path / "metrics.jsonl").is_file()


def test_bad_job_file_is_one_line_and_exit_2(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        (ROOT / "examples/digits_mlp.yaml").read_text().replace("batch_size: 64", "batch_size: -64")
    )
    r = raysinga("train", str(job), cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "raysinga: error: data.batch_size: expected an integer >= 1, got -64"
    ]
    assert "Traceback" not in r.stderr


def test_help_lists_train():
    r = raysinga("--help", cwd=ROOT)
    assert r.returncode == 0 and "train" in r.stdout
