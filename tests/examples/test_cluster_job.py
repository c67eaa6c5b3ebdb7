"""The real sequence a user runs on loopback: ray start --head, ray job submit, ray stop."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_cli(*args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "ray"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.ray_stop
def test_ray_job_submit_of_the_example_succeeds_and_logs_the_accuracy():
    import ray

    ray.shutdown()  # `ray stop` would end the session's embedded Ray anyway
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    port, dash = free_port(), free_port()
    start = ray_cli(
        "start",
        "--head",
        f"--port={port}",
        f"--dashboard-port={dash}",
        "--num-cpus=2",
        "--disable-usage-stats",
        env=env,
        timeout=180,
    )
    assert start.returncode == 0, start.stderr
    try:
        submit = ray_cli(
            "job",
            "submit",
            f"--address=http://127.0.0.1:{dash}",
            "--working-dir",
            ".",
            "--",
            "python",
            "examples/cluster_digits.py",
            "--set",
            "train_steps=300",
            "--set",
            "disp_freq=100",
            env={**env, "RAY_AUTH_MODE": "token"},
            timeout=600,
        )
        log = submit.stdout + submit.stderr
        assert submit.returncode == 0, log
        assert "succeeded" in log
        acc = float(log.split("final test accuracy: ")[1].split()[0])
        assert acc >= 0.9, log
    finally:
        stop = ray_cli("stop", env=env, timeout=120)
    assert stop.returncode == 0, stop.stderr
