"""``ray job submit`` from outside the cluster, as a user submits from a laptop, to emulated
hosts that share nothing but a network (tests/hosts.py): a head without CPUs, and two hosts
whose Python has Ray and raysinga's dependencies but not raysinga (the job ships it). Once
training is under way, the host running the workers is lost whole: the job goes on on the
other host and succeeds. Without shipping, the hosts that cannot import raysinga are named in
one line; so is a host whose Python lacks one of its dependencies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import hosts
import pytest
from helpers import node_env

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(module_lab, node_python):
    made = hosts.ray_cluster(module_lab, [0, 2, 2], python=node_python)
    head, *nodes = made
    for h in nodes:  # what each host's roles run with: no raysinga there
        r = h.run([node_python, "-c", "import raysinga"])
        assert r.returncode != 0 and "No module named 'raysinga'" in r.stdout, r.stdout
    token = head.path("/root/.ray/auth_token").read_text().strip()
    return made, token


def ray_cli(*args: str, token: str, timeout: float) -> subprocess.CompletedProcess:
    """``ray ARGS`` here, outside the hosts, with the cluster's token (a user copies it)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, NO_PROXY="*", no_proxy="*")
    return subprocess.run(
        [str(Path(sys.executable).parent / "ray"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def trained_to(head, run_dir: str, step: int) -> bool:
    f = head.path(f"{run_dir}/metrics.jsonl")
    if not f.exists():
        return False
    for line in f.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "train" and rec["step"] >= step:
            return True
    return False


def test_layers_of_the_users_own_train_on_hosts_without_raysinga_or_their_module(cluster):
    """examples/custom_layers/: charlm with RMSNorm and SwiGLU of the user's own module, two
    workers and two servers on hosts that have neither raysinga nor that module: the run
    ships both (docs/layers.md)."""
    (head, *nodes), _ = cluster
    for h in nodes:
        r = h.run([h.own_python, "-c", "import mylayers"])
        assert r.returncode != 0 and "No module named 'mylayers'" in r.stdout, r.stdout
    run_dir = "/mnt/shared/custom-layers"
    args = [str(Path(sys.executable).parent / "raysinga"), "train"]
    args += [str(ROOT / "examples" / "custom_layers" / "charlm.yaml")]
    args += ["--address", f"{head.address}:6379"]
    sets = ["train_steps=4", "disp_freq=2", "test_freq=0", "data.source.max_chars=200000"]
    sets += ["data.source.valid_every=10", f"run_dir={run_dir}"]
    run = head.run([*args, *[x for s in sets for x in ("--set", s)]], timeout=900)
    assert run.returncode == 0, run.stdout
    # (the head has no CPU: every role ran on the hosts)
    assert "bits per character" in run.stdout and "Traceback" not in run.stdout, run.stdout


def test_a_job_submitted_from_outside_to_hosts_without_raysinga_survives_losing_one(cluster):
    (head, *nodes), token = cluster
    run_dir = "/mnt/shared/submitted"
    # Long enough that the run cannot end between the test seeing step 150 and the loss (it
    # ran the 450 steps left of 600 in about 2 s on an idle machine): once the host is lost the
    # run cannot go on without noticing, since its workers were there.
    steps = 3000
    sets = [f"train_steps={steps}", "disp_freq=50", "checkpoint_frequency=500"]
    sets.append(f"run_dir={run_dir}")
    at = f"--address=http://{head.address}:8265"
    cmd = ["job", "submit", at, "--submission-id", "lose-a-host", "--no-wait"]
    cmd += ["--working-dir", ".", "--", "python", "examples/cluster_digits.py"]
    cmd += [x for s in sets for x in ("--set", s)]
    for _ in range(6):  # the head's job agent may come up a moment after `ray start`
        submit = ray_cli(*cmd, token=token, timeout=300)
        if "No available agent to submit job" not in submit.stdout + submit.stderr:
            break
        time.sleep(5)
    assert submit.returncode == 0, submit.stdout + submit.stderr

    def wait_for(step: int) -> None:
        deadline = time.monotonic() + 300
        while not trained_to(head, run_dir, step):
            if time.monotonic() > deadline:
                logs = ray_cli("job", "logs", at, "lose-a-host", token=token, timeout=60)
                raise AssertionError(f"no step {step} in 300 s:\n{logs.stdout}{logs.stderr}")
            time.sleep(0.2)

    wait_for(50)  # the roles are placed: find the victim before the instant of the loss
    held = hosts.roles_by_host(head, nodes)
    (victim,) = [h for h in nodes if "Worker" in held[h.name] and "Stub" in held[h.name]]
    wait_for(150)
    victim.lose()
    assert not trained_to(head, run_dir, steps), "the run ended before the host was lost"
    follow = ray_cli("job", "logs", at, "lose-a-host", "--follow", token=token, timeout=600)
    status = ray_cli("job", "status", at, "lose-a-host", token=token, timeout=60)
    log = follow.stdout
    assert "SUCCEEDED" in status.stdout.upper(), status.stdout + log
    assert f"node(s) {victim.address} unreachable" in log, log
    assert "recovering (failure 1 of at most 3)" in log, log
    assert "ModuleNotFoundError" not in log and "Traceback" not in log, log
    assert float(log.split("final test accuracy: ")[1].split()[0]) >= 0.9, log


def raysinga_train(head, run_dir: str, *more: str) -> subprocess.CompletedProcess:
    """``raysinga train`` of the digits MLP on the head, whose Python has raysinga."""
    args = [str(Path(sys.executable).parent / "raysinga"), "train"]
    args += [str(ROOT / "examples" / "digits_mlp.yaml"), "--address", f"{head.address}:6379"]
    args += ["--set", "train_steps=100", "--set", f"run_dir={run_dir}", *more]
    return head.run(args, timeout=600)


def one_error(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 1, run.stdout
    errors = [line for line in run.stdout.splitlines() if line.startswith("raysinga: error:")]
    assert len(errors) == 1 and "Traceback" not in run.stdout, run.stdout
    return errors[0]


def test_without_shipping_the_hosts_that_cannot_import_raysinga_are_named(cluster, node_python):
    (head, *_), _ = cluster
    run = raysinga_train(head, "/mnt/shared/no-ship", "--no-ship")
    error = one_error(run)
    assert "cannot import raysinga" in error and node_python in error, error
    assert "--no-ship" in error, error
    assert not head.path("/mnt/shared/no-ship/checkpoints").exists()


def test_a_host_without_a_dependency_is_named_in_one_line(cluster, module_lab, tmp_path):
    """A host whose Python lacks pyarrow joins: the run stops before any role, naming the
    host, the module and the remedy, in one line and without a traceback."""
    (head, *nodes), _ = cluster
    lacking = node_env(tmp_path, without=("pyarrow",))
    host = module_lab.host(f"h{len(nodes) + 2}", shared=True, python=lacking)
    host.ray_start(1, head=head)
    hosts.wait_joined(head, host)  # (a host of the module lost by an earlier test may count)
    error = one_error(raysinga_train(head, "/mnt/shared/lacking"))
    assert "cannot import pyarrow" in error and lacking in error, error
    assert host.address in error and "pip install pyarrow" in error, error
    assert not head.path("/mnt/shared/lacking/checkpoints").exists()  # nothing was written
