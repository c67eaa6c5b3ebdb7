"""examples/node_loss.py as a user runs it, at a small scale: a node lost mid-run, the run going
on with one worker, then growing back to two when a node returns. The demo makes its nodes on
the one machine it runs on (``ray.cluster_utils``), by design: it is marked ``slow``, not
``cluster`` (the tier of emulated hosts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_node_loss_demo_shrinks_recovers_and_grows_back():
    sets = ["train_steps=200", "disp_freq=20", "checkpoint_frequency=50"]
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/node_loss.py"),
            "--elastic",
            "--kill-at",
            "60",
            "--return-at",
            "120",
            *(x for s in sets for x in ("--set", s)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "--- removing node" in out and "--- adding a node" in out, out
    after = r.stdout.split("--- events\n")[1].splitlines()
    events = [json.loads(x) for x in after if x.startswith("{")]
    assert after[-1].startswith("the run is in ") and "raysinga plot" in after[-1], out
    assert [(e["kind"], e["workers"]) for e in events] == [("failure", 1), ("resize", 2)], out
    assert events[0]["restored_from"] == 50 and events[0]["steps_redone"] == 10
    assert float(out.split("final test accuracy: ")[1].split()[0]) >= 0.9, out
