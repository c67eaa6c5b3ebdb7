"""``raysinga status`` against a live run (raysinga/distributed/status.py): while a lost worker
is being recovered it shows that worker recovering, every other role stepping on its node, and
the run recovering, from its run directory and (``--address``) from the cluster by the run's
name; once the run is done, its state, its latest checkpoint and the recovery. While a run
steps, each role's pid; after it, no spare. A driver SIGKILLed shown dead on its host, one long
silent shown silent anywhere; a run's name looked for where it is said to be; a reader that
closes the pipe early."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import cli_error, load_job, signal_worker_at

from raysinga import cli
from raysinga.distributed import DistributedTrainer
from raysinga.distributed.status import read, render
from raysinga.obs.events import CheckpointCommitted, RoleLost, TrainStep

JOB = """
name: watched
seed: 2
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 32, activation: relu}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 32}
updater: {name: sgd, lr: 0.05}
train_steps: 60
disp_freq: 10
test_freq: 0
checkpoint_frequency: 20
topology: {preset: sandblaster, n_servers: 2, workers_per_group: 2}
"""


def status(run_dir, *more: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "raysinga.cli", "status", str(run_dir), *more]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_status_shows_a_recovering_role_while_the_recovery_is_under_way(ray_session, tmp_path):
    t = DistributedTrainer(load_job(tmp_path, JOB), log=lambda line: None)
    fired = signal_worker_at(t, 30, signal.SIGKILL)
    during: list[subprocess.CompletedProcess] = []

    # the cluster's address, as a machine elsewhere would be given it
    address = ray_session.get_runtime_context().gcs_address

    committed: list[int] = []  # the steps of the checkpoints the run announced, in order
    known: list[int | None] = []  # the newest of them before and after the status was read

    def newest() -> int | None:
        return committed[-1] if committed else None

    def on_loss(ev) -> None:  # the recovery waits for this: it is under way meanwhile
        if isinstance(ev, CheckpointCommitted):
            committed.append(ev.step)
        if isinstance(ev, RoleLost) and not during:
            known.append(newest())
            during.append(status(tmp_path, "--json"))
            during.append(status(tmp_path))
            during.append(status("watched", "--address", address, "--json"))
            known.append(newest())

    t.hub.subscribe(on_loss)
    t.fit()
    assert fired and len(during) == 3, "the loss was never seen"
    as_json, as_text, live = during
    assert as_json.returncode == 0, as_json.stderr
    st = json.loads(as_json.stdout)
    # from the cluster's key-value store, by the run's name: the same
    assert live.returncode == 0, live.stderr
    assert json.loads(live.stdout) == st
    assert st["run"] == "watched" and st["state"] == "recovering", st
    by_state = {}
    for r in st["roles"]:
        by_state.setdefault(r["state"], []).append((r["role"], r["index"], r["group"]))
        if r["state"] != "spare":
            assert r["node"], r  # where it runs, as the run's hosts are named
    assert by_state["recovering"] == [("worker", 1, 0)], st["roles"]
    # the pid shown for the lost worker is the process that was killed
    assert [r["pid"] for r in st["roles"] if r["state"] == "recovering"] == fired, st["roles"]
    stepping = set(by_state["stepping"])
    assert {("server", 0, None), ("server", 1, None), ("worker", 0, 0), ("stub", 0, 0)} <= stepping
    # the newest checkpoint committed so far (step 20's is written in the background, and
    # on a busy machine may not have been committed by the loss at step 30)
    shown = (st["checkpoint"] or {}).get("step")
    assert set(known) <= {None, 20, 30} and shown in known and st["step"] >= 20, (known, st)
    assert "recovering" in as_text.stdout and "worker" in as_text.stdout, as_text.stdout
    # after the run
    done = read(tmp_path)
    assert done["state"] == "finished" and done["step"] == 60, done
    assert [r["role"] for r in done["recoveries"]] == ["worker"], done
    assert done["checkpoint"]["step"] == 60
    assert {r["state"] for r in done["roles"]} == {"finished"}, done["roles"]
    text = render(done)
    assert text.splitlines()[0].startswith("run watched: finished, step 60/60"), text
    assert "recoveries: 1" in text and "latest checkpoint: step 60" in text, text


def test_a_directory_without_a_status_is_one_line(tmp_path):
    r = status(tmp_path)
    assert r.returncode == 2 and "no status here" in r.stderr and "\n" not in r.stderr.strip()


def test_address_without_a_cluster_or_without_the_run_is_one_line(ray_session):
    r = status("watched", "--address", "127.0.0.1:1")  # nothing listens there
    assert r.returncode == 2 and "no Ray cluster reached" in r.stderr, r.stderr
    assert "\n" not in r.stderr.strip(), r.stderr
    address = ray_session.get_runtime_context().gcs_address
    r = status("never-ran", "--address", address)
    assert r.returncode == 2 and "no run named 'never-ran'" in r.stderr, r.stderr


def write_status(run_dir: Path, **fields) -> dict:
    """A status file as a driver writes it (``fields`` over a running run's), in ``run_dir``."""
    st = {
        "run": "watched",
        "pid": 1,
        "host": "another-machine",
        "pid_started": None,
        "state": "running",
        "step": 30,
        "total": 60,
        "step_ms": 2.0,
        "report_s": 0.5,
        "samples_per_s": 1000.0,
        "checkpoint": None,
        "recoveries": [],
        "recovering": [],
        "roles": [],
        "updated": time.time(),
        **fields,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").write_text(json.dumps(st))
    return st


def shown(*args) -> tuple[int, str]:
    """``raysinga status ARGS`` run in this process (no interpreter to start): its exit status
    and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["status", *map(str, args)])
    return code, out.getvalue()


def test_a_name_without_its_run_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = cli_error("status", "nosuch", named=["nosuch/", "runs/nosuch/", str(Path.cwd())])
    assert "a run's name stands for runs/NAME" in line, line
    cli_error("status", str(tmp_path / "gone"), named=f"{tmp_path / 'gone'}: no such run dir")
    # a directory of that name without a status: the run's name still finds runs/NAME
    (tmp_path / "there").mkdir()
    write_status(tmp_path / "runs" / "there", run="there")
    code, out = shown("there")
    assert code == 0 and out.startswith("run there: running"), out


def test_a_reader_that_closes_the_pipe_ends_status_quietly(tmp_path):
    """``raysinga status RUN | head -1``: more than a pipe holds, read one line and the pipe
    closed; the command ends as a Unix tool does (status 128 + SIGPIPE), with nothing on
    stderr, each of several times."""
    roles = [
        {"role": "worker", "index": i, "group": 0, "node": "192.0.2.1", "pid": 1000 + i}
        | {"state": "stepping", "step_ms": 2.0}
        for i in range(3000)  # some 200 KB of text, past a pipe's 64 KiB
    ]
    write_status(tmp_path, roles=roles)
    cmd = [sys.executable, "-m", "raysinga.cli", "status", str(tmp_path)]
    for more in ([], [], ["--json"]):
        p = subprocess.Popen(
            [*cmd, *more], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        first = p.stdout.readline()
        p.stdout.close()
        err = p.stderr.read()
        p.wait(timeout=60)
        assert first.startswith("{" if more else "run watched: running"), first
        assert err == "" and p.returncode == 128 + signal.SIGPIPE, (p.returncode, err)


def test_status_shows_each_roles_pid_and_no_spare_once_the_run_ended(ray_session, tmp_path):
    """While the run steps: every role with its node and the pid of its process (a worker's,
    as the worker itself says); once it finished, its roles and no spare."""
    t = DistributedTrainer(load_job(tmp_path, JOB, "train_steps=40"), log=lambda line: None)
    during: list[dict] = []

    def at(ev) -> None:
        if isinstance(ev, TrainStep) and ev.step == 30 and not during:
            st = read(tmp_path)
            workers = [ray_session.get(w.pid.remote()) for w in t.workers[0]]
            during.append({"status": st, "workers": workers})

    t.hub.subscribe(at)
    t.fit()
    (seen,) = during
    roles = [r for r in seen["status"]["roles"] if r["state"] != "spare"]
    assert len(roles) == 5 and all(r["node"] and r["pid"] for r in roles), roles
    assert [r["pid"] for r in roles if r["role"] == "worker"] == seen["workers"], roles
    assert len({r["pid"] for r in roles}) == 5, roles  # a process each
    assert all(r["pid"] != os.getpid() for r in roles), roles
    text = render(seen["status"])
    for r in roles:
        assert f" {r['pid']}  stepping" in text, text
    done = read(tmp_path)
    # the run had spares, which ended with it
    assert any(r["state"] == "spare" for r in seen["status"]["roles"]), seen["status"]
    assert [(r["role"], r["state"]) for r in done["roles"]] == [
        ("server", "finished"),
        ("server", "finished"),
        ("worker", "finished"),
        ("worker", "finished"),
        ("stub", "finished"),
    ], done["roles"]


def started(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since boot, as /proc/PID/stat says."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])


def test_a_driver_whose_process_is_gone_is_shown_dead(tmp_path):
    """A run whose status names a process of this host: shown as it reported while that
    process lives; dead, and its roles gone, once a SIGKILL ended it."""
    driver = subprocess.Popen(["sleep", "600"])
    try:
        role = {"role": "worker", "index": 0, "group": 0, "node": "192.0.2.1", "pid": 7}
        roles = [{**role, "state": "stepping", "step_ms": 2.0}]
        mine = {"pid": driver.pid, "host": socket.gethostname(), "roles": roles}
        write_status(tmp_path, **mine, pid_started=started(driver.pid))
        code, alive = shown(tmp_path)
        assert code == 0 and alive.startswith("run watched: running, step 30/60"), alive
        assert f"driver: pid {driver.pid} on {socket.gethostname()}" in alive, alive
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        dead = status(tmp_path)  # as a user runs it
        head = dead.stdout.splitlines()[0]
        assert head.startswith("run watched: dead: its driver"), dead.stdout + dead.stderr
        assert f"pid {driver.pid} on {socket.gethostname()}) is gone" in head, head
        assert "it last reported running, step 30/60" in head, head
        assert "(as of" not in head, head
        assert "gone" in dead.stdout.splitlines()[-1], dead.stdout  # its roles went with it
        as_json = json.loads(shown(tmp_path, "--json")[1])
        assert as_json["driver"]["state"] == "dead", as_json
        # a pid given to another process since is not the driver
        reused = {**mine, "pid": os.getpid(), "pid_started": started(os.getpid()) + 1}
        write_status(tmp_path, **reused)
        assert "dead: its driver" in shown(tmp_path)[1]
    finally:
        driver.kill()


def test_a_driver_silent_far_longer_than_it_reported_is_named(tmp_path):
    """On a host this reader cannot look at, a running run's step reports overdue by far
    (here 10 minutes, where they came every half second) say that its driver may have died; a
    report a few seconds late, a finished run's old status, say nothing of the kind."""
    write_status(tmp_path, updated=time.time() - 600)
    head = shown(tmp_path)[1].splitlines()[0]
    assert head.startswith("run watched: silent: no report from its driver (pid 1 on "), head
    assert re.search(r"for 60\d s, where one came every 0.5 s: it may have died;", head), head
    write_status(tmp_path, updated=time.time() - 5)
    assert shown(tmp_path)[1].startswith("run watched: running, step 30/60")
    write_status(tmp_path, state="finished", step=60, updated=time.time() - 3600)
    assert shown(tmp_path)[1].startswith("run watched: finished, step 60/60")


@pytest.mark.slow
def test_status_shows_a_sigkilled_driver_dead(ray_session, tmp_path):
    """A driver (``raysinga train`` on the session's Ray) SIGKILLed while it trains:
    ``raysinga status`` on its host says its driver is gone, no longer ``running``."""
    job = JOB.replace("train_steps: 60", "train_steps: 1000000")
    (tmp_path / "job.yaml").write_text(
        job.replace("checkpoint_frequency: 20", "checkpoint_frequency: 0")
    )
    address = ray_session.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "raysinga.cli", "train", str(tmp_path / "job.yaml")]
    cmd += ["--address", address, "--set", f"run_dir={tmp_path}"]
    with open(tmp_path / "console.txt", "w") as console:
        p = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            st = (
                json.loads((tmp_path / "status.json").read_text())
                if (tmp_path / "status.json").exists()
                else {}
            )
            if st.get("state") == "running" and st.get("step", 0) >= 20:
                break
            assert p.poll() is None, (tmp_path / "console.txt").read_text()
            assert time.monotonic() < deadline, st
            time.sleep(0.1)
        assert st["pid"] == p.pid, st
        alive = status(tmp_path)
        assert alive.stdout.startswith("run watched: running, step"), alive.stdout + alive.stderr
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        p.kill()
    dead = status(tmp_path)
    head = dead.stdout.splitlines()[0]
    assert dead.returncode == 0, dead.stderr
    assert head.startswith(
        f"run watched: dead: its driver (pid {p.pid} on {socket.gethostname()}) is gone"
    ), dead.stdout
    assert "it last reported running" in head and "(as of" not in head, head
    rows = dead.stdout.splitlines()[5:]
    assert rows and all(" gone " in row for row in rows), dead.stdout
    assert json.loads(status(tmp_path, "--json").stdout)["driver"]["state"] == "dead"
