"""Token authentication as the Ray that raysinga installs does it, and as docs/cluster.md says:
``ray start --head`` on a machine without a token (and no ``RAY_AUTH_MODE``) runs without
authentication, and a driver joins it with no setting."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port, group_of, stop_group

ROOT = Path(__file__).resolve().parents[2]
RAY_CLI = [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]


def test_the_docs_say_when_ray_start_turns_authentication_on():
    text = (ROOT / "docs/cluster.md").read_text()
    assert "turns token authentication on for clusters started with `ray start`" not in text
    for said in (
        "Token authentication is disabled for this Ray cluster",
        "RAY_AUTH_MODE=token ray start --head",
        "ray get-auth-token --generate",
        "~/.ray/auth_token",
    ):
        assert said in text, said


@pytest.mark.slow  # a `ray start` of its own, and a driver joining it
def test_ray_start_without_a_token_runs_without_authentication(tmp_path):
    """A head started as a user starts one on a machine that has no token (a home of its
    own, no RAY_AUTH_MODE) says authentication is off, and a driver with no setting joins.
    Only the processes of that head are stopped afterwards (its process group)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env = {**{k: v for k, v in env.items() if k != "RAY_ADDRESS"}, "HOME": str(home)}
    port, temp = free_port(), Path("/tmp") / f"rs-auth-{os.getpid()}"  # short: Ray's sockets
    cmd = [*RAY_CLI, "start", "--head", f"--port={port}", "--num-cpus=1", f"--temp-dir={temp}"]
    cmd += ["--include-dashboard=false", "--disable-usage-stats"]
    cmd += [
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
    ]
    p = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out
        assert "Token authentication is disabled for this Ray cluster" in out, out
        join = "import ray; ray.init(address=%r, log_to_driver=False); print(ray.is_initialized())"
        r = subprocess.run(
            [sys.executable, "-c", join % f"127.0.0.1:{port}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0 and r.stdout.strip().endswith("True"), r.stderr
        assert not (home / ".ray" / "auth_token").exists()  # nobody made a token meanwhile
    finally:
        stop_group(p.pid)
        shutil.rmtree(temp, ignore_errors=True)
    assert not group_of(p.pid), "the head's processes outlived the stop"
