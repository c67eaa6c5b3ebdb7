"""The CNN and Downpour job files and the fine-tuning example, as their docstrings say to run
them, at a small scale."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]


def train(job: str, run_dir: Path, *sets: str) -> subprocess.CompletedProcess:
    """``raysinga train examples/JOB`` with ``--set`` overrides, in its own process."""
    overrides = [a for s in (*sets, f"run_dir={run_dir}") for a in ("--set", s)]
    return run_cli("train", str(ROOT / "examples" / job), *overrides, cwd=run_dir, timeout=600)


@pytest.mark.slow
def test_the_cnn_job_trains_on_two_workers(tmp_path):
    r = train("digits_cnn.yaml", tmp_path, "train_steps=150", "test_freq=150", "disp_freq=50")
    assert r.returncode == 0, r.stderr
    assert "sandblaster, 1 server(s), 1 group(s) x 2 worker(s)" in r.stdout
    assert float(r.stdout.split("final test accuracy: ")[1].split()[0]) >= 0.8, r.stdout
    assert (tmp_path / "checkpoints" / "step-150" / "manifest.msgpack").is_file()


@pytest.mark.slow
def test_the_downpour_job_trains_two_asynchronous_groups(tmp_path):
    r = train("digits_downpour.yaml", tmp_path, "train_steps=300", "test_freq=300")
    assert r.returncode == 0, r.stderr
    assert "downpour, 1 server(s), 2 group(s) x 1 worker(s)" in r.stdout
    assert float(r.stdout.split("final test accuracy: ")[1].split()[0]) >= 0.85, r.stdout


@pytest.mark.slow
def test_fine_tuning_reuses_the_base_layers_under_new_ones(ray_session):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import finetune_digits
    finally:
        sys.path.remove(str(ROOT / "examples"))
    out = finetune_digits.main(["--base-steps", "200", "--steps", "150"])
    # fc1 and fc2 (W and b) from the base; fc3 and cls new; the base head out unused
    assert out["base_checkpoint"].endswith("/checkpoints/step-200"), out
    assert out["report"].startswith("matched 4, missing 4, unexpected 2, shape-mismatched 0\n")
    assert "missing (initialised fresh): fc3/W" in out["report"]
    assert "unexpected (ignored): out/W" in out["report"]
    assert out["tuned_accuracy"] >= 0.85, out


@pytest.mark.slow
def test_the_api_tour_runs_as_docs_api_says(ray_session):
    """examples/api_tour.py: the result's checkpoint, the registry's key read in another Ray
    task, and a renamed fine-tune whose report comes with its result."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import api_tour
    finally:
        sys.path.remove(str(ROOT / "examples"))
    out = api_tour.main(["--steps", "150"])
    assert out["checkpoint"].endswith("/base/checkpoints/step-150"), out
    assert set(out["norms"]) == {"fc1/W", "fc1/b", "out/W", "out/b"}
    assert all(v > 0 for v in out["norms"].values())
    assert out["report"].perfect and sorted(out["report"].matched) == [
        "hidden/W",
        "hidden/b",
        "out/W",
        "out/b",
    ]
    assert out["accuracy"] >= 0.85 and out["tuned_accuracy"] >= 0.85, out
