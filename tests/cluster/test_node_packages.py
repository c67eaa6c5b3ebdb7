"""What a node needs when the run ships raysinga, said once (``node_probe.NODE_PACKAGES``,
listed in docs/cluster.md) and held: an emulated host whose Python has Ray and those packages
and nothing else trains the digits job, its code shipped; the digits data set is
scikit-learn's, so that host has it too, as docs/cluster.md says of the examples."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import hosts
import pytest
from helpers import node_env

from raysinga.cluster.node_probe import NODE_PACKAGES

pytestmark = [pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[2]


def test_a_node_with_only_the_listed_packages_trains_the_digits_job_shipped(lab, tmp_path):
    thin = node_env(tmp_path, only=("ray[default]", *NODE_PACKAGES.values(), "scikit-learn"))
    for module in ("raysinga", "ml_dtypes", "tensorboardX", "mlflow", "torch"):
        assert not imports(thin, module), f"{module} imports in the node's Python"
    # the head has no CPU: every role runs on the node
    head, _ = hosts.ray_cluster(lab, [0, 2], python=thin)
    run_dir = "/mnt/shared/thin"
    args = [str(Path(sys.executable).parent / "raysinga"), "train"]
    args += [str(ROOT / "examples" / "digits_mlp.yaml"), "--address", f"{head.address}:6379"]
    args += ["--set", "train_steps=200", "--set", "test_freq=0", "--set", f"run_dir={run_dir}"]
    run = head.run(args, timeout=600)
    assert run.returncode == 0, run.stdout
    assert "Traceback" not in run.stdout and "cannot import" not in run.stdout, run.stdout
    accuracy = re.search(r"final test accuracy: ([0-9.]+)", run.stdout)
    assert accuracy and float(accuracy.group(1)) > 0.5, run.stdout


def imports(python: str, module: str) -> bool:
    """Whether ``python`` imports ``module``, run outside the checkout (whose ``raysinga/``
    directory a Python started there would find)."""
    run = subprocess.run([python, "-c", f"import {module}"], cwd="/", capture_output=True)
    return run.returncode == 0
