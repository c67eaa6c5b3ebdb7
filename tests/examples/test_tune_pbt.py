"""examples/tune_pbt.py as a user runs it, on a tiny budget: both searches finish, each prints
its best trial and its population's median and worst, and the plot is drawn."""

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
        m = re.search(
            rf"^{name}: best trial validation loss (\S+) bits per character .* median (\S+), "
            r"worst (\S+)$",
            r.stdout,
            re.M,
        )
        assert m, r.stdout
        best, median, worst = (float(v) for v in m.groups())
        assert 0 < best <= median <= worst < 8, r.stdout  # under 7 bits: 98 characters
    assert f"plot: {png}" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
