"""examples/fork_lr.py as a user runs it: forks of one object-store checkpoint as Ray tasks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_forks_of_one_checkpoint_train_from_memory():
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/fork_lr.py"),
            "--base-steps",
            "40",
            "--steps",
            "30",
            "--lrs",
            "0.01",
            "0.05",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "its directory is gone" in r.stdout  # the forks cannot have read it from disk
    accs = re.findall(r"fork lr (\S+) +30 steps from step 40: test accuracy (\S+)", r.stdout)
    assert [a for a, _ in accs] == ["0.01", "0.05"], r.stdout
    assert all(0.5 < float(acc) <= 1.0 for _, acc in accs), r.stdout
