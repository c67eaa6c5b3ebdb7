"""examples/tune_pbt.py as a user runs it, on a tiny budget: both searches finish, each prints
its best trial, and the plot is drawn."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pbt_and_random_search_of_one_budget(tmp_path):
    png = tmp_path / "curves.png"
    args = ["--trials", "4", "--steps", "40", "--report-every", "10", "--plot", str(png)]
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples/tune_pbt.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "budget: 4 trials x 40 steps each, per search" in r.stdout
    for name in ("pbt", "random"):
        m = re.search(rf"^{name}: best trial test accuracy (\S+), test loss (\S+) ", r.stdout, re.M)
        assert m, r.stdout
        assert 0.0 <= float(m[1]) <= 1.0 and float(m[2]) > 0, r.stdout
    assert r.stdout.count("the population's test accuracy at the end: worst ") == 2, r.stdout
    assert f"plot: {png}" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
