"""The real sequence a user runs on loopback: ray start --head, ray job submit, then the head
stopped again. Not with `ray stop`, which ends every Ray on the machine (a user may run the suite
beside their own cluster): the head is started in a process group of its own, and exactly that
group is stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ray_start_cluster, run_cli, trained_to

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def ray_cli(*args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``ray ARGS``, without the session's RAY_ADDRESS=local: Ray's job client takes that
    variable over an ``--address`` given to it."""
    return subprocess.run(
        [str(BIN / "ray"), *args],
        cwd=ROOT,
        env={k: v for k, v in env.items() if k != "RAY_ADDRESS"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.ray_stop
def test_ray_job_submit_of_the_example_succeeds_and_logs_the_accuracy(tmp_path):
    import ray

    ray.shutdown()  # two clusters at once are too much for two cores; later tests restart it
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    with ray_start_cluster([], env, head_cpus=2) as (_, dash, _):
        for _ in range(6):  # the head's job agent may come up a moment after `ray start`
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
                "--set",
                f"run_dir={tmp_path / 'run'}",  # the example's own default is in $HOME
                env={**env, "RAY_AUTH_MODE": "token"},
                timeout=600,
            )
            if "No available agent to submit job" not in submit.stdout + submit.stderr:
                break
            time.sleep(5)
    log = submit.stdout + submit.stderr
    assert submit.returncode == 0, log
    assert "succeeded" in log
    acc = float(log.split("final test accuracy: ")[1].split()[0])
    assert acc >= 0.9, log
    assert f"run record and checkpoints in {tmp_path / 'run'}" in log, log
    assert "temporary copy" not in log, log
    assert (tmp_path / "run" / "checkpoints" / "step-300").is_dir()


@pytest.mark.slow
@pytest.mark.ray_stop
def test_ray_job_stop_commits_a_checkpoint_and_auto_resume_ends_bit_identical(tmp_path):
    """`ray job stop` sends SIGTERM, then SIGKILL 3 s later: the run commits a checkpoint in
    that window and stops; the job submitted again with --auto-resume ends with the bits of
    a run never stopped."""
    import ray

    from raysinga.checkpoint import Checkpoint

    ray.shutdown()
    sets = ["--set", "train_steps=6000", "--set", "disp_freq=50", "--set", "test_freq=0"]
    sets += ["--set", "checkpoint_frequency=2000"]
    a_dir = f"run_dir={tmp_path}/a"
    want = run_cli("train", "examples/digits_mlp.yaml", *sets, "--set", a_dir, cwd=ROOT)
    assert want.returncode == 0, want.stderr
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    job_env = {**env, "RAY_AUTH_MODE": "token"}
    run_dir = tmp_path / "b"
    with ray_start_cluster([], env, head_cpus=2) as (_, dash, _):
        at = f"--address=http://127.0.0.1:{dash}"

        def submit(sid: str, *more: str, wait: bool = True) -> subprocess.CompletedProcess:
            cmd = ["job", "submit", at, "--submission-id", sid, "--working-dir", "."]
            cmd += [] if wait else ["--no-wait"]
            cmd += ["--", "raysinga", "train", "examples/digits_mlp.yaml", *sets]
            cmd += ["--set", f"run_dir={run_dir}", *more]
            for _ in range(6):  # the head's job agent may come up a moment after `ray start`
                done = ray_cli(*cmd, env=job_env, timeout=600)
                if "No available agent to submit job" not in done.stdout + done.stderr:
                    return done
                time.sleep(5)
            return done

        first = submit("stop-1", wait=False)
        assert first.returncode == 0, first.stdout + first.stderr
        deadline = time.monotonic() + 300
        while not trained_to(run_dir, 550):
            assert time.monotonic() < deadline, ray_cli(
                "job", "logs", at, "stop-1", env=job_env, timeout=60
            ).stdout
            time.sleep(0.1)
        t0 = time.monotonic()
        stop = ray_cli("job", "stop", at, "stop-1", env=job_env, timeout=120)
        stop_s = time.monotonic() - t0
        log = ray_cli("job", "logs", at, "stop-1", env=job_env, timeout=60).stdout
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert "stopped by SIGTERM" in log, log  # not SIGKILLed 3 s after the SIGTERM
        second = submit("stop-2", "--auto-resume")
        out = second.stdout + second.stderr
        assert second.returncode == 0 and "succeeded" in out, out
        assert "resuming 'digits-mlp' at step" in out, out
    print(f"ray job stop returned after {stop_s:.2f} s")
    a = Checkpoint.open(tmp_path / "a" / "checkpoints" / "step-6000")
    b = Checkpoint.open(run_dir / "checkpoints" / "step-6000", verify="full")
    for name in a.names("param"):
        assert a.array(name).tobytes() == b.array(name).tobytes(), name
