"""The command line as a user runs it: a real subprocess."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from raysinga.checkpoint import Checkpoint

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


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_stops_a_distributed_run(tmp_path):
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "raysinga.cli",
            "train",
            str(ROOT / "examples/digits_mlp.yaml"),
            "--set",
            "train_steps=1000000",
            "--set",
            f"run_dir={tmp_path}",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # a shell's background jobs ignore SIGINT; a user's terminal does not
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("step"):
            break
    p.send_signal(signal.SIGINT)
    try:
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, "".join(lines) + out
    last = out.rstrip().splitlines()[-1]
    m = re.fullmatch(
        r"raysinga: stopped by SIGINT at step (\d+); checkpoint (\S+); continue with --resume", last
    )
    assert m, out
    ck = Checkpoint.open(m.group(2), verify="full")
    assert ck.step == int(m.group(1)) > 0 and m.group(2).endswith(f"step-{ck.step}")
