"""A run tracked in MLflow (the job's ``mlflow``; raysinga/obs/mlflow_log.py), read back with
MLflow's own client from a local file store: the resolved job as parameters, the metrics by
step as ``metrics.jsonl`` has them, each checkpoint as a tag, and after ``--resume`` the same
MLflow run. A driver SIGKILLed past its last checkpoint and resumed logs each step once; a
resume that changes the job tags each change and says so in one warning. A tracking server that
cannot be reached, or a file store MLflow refuses: the same training, one warning that says
which."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import run_cli

from raysinga import config
from raysinga.obs.tensorboard import record_scalars
from raysinga.run import Trainer

mlflow = pytest.importorskip("mlflow")

JOB = """
name: tracked
seed: 1
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 32, activation: relu}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 64}
updater: {name: sgd, lr: 0.05, momentum: 0.9}
train_steps: 60
disp_freq: 10
test_freq: 30
checkpoint_frequency: 20
"""


@pytest.fixture
def store(tmp_path, monkeypatch):
    # MLflow 3 keeps its file store for those who ask for it
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"file://{tmp_path / 'mlruns'}"


def train(tmp_path: Path, uri: str, *more: str):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    sets = [f"run_dir={tmp_path / 'run'}", f"mlflow={{tracking_uri: '{uri}', experiment: e}}"]
    args = ["train", str(job), "--local", *more]
    return run_cli(*args, *(x for s in sets for x in ("--set", s)))


def tracked(job: Path, run: Path, uri: str, *more: str):
    """The job at ``job``, run in ``run``, tracked in MLflow at ``uri``."""
    section = f"mlflow={{tracking_uri: '{uri}', experiment: e}}"
    return config.load(job, [f"run_dir={run}", section, *more])


def records(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


@pytest.mark.slow  # three runs of the job: the default tier's time
def test_the_run_is_in_mlflow_as_in_its_own_files_and_a_resume_goes_on_in_it(tmp_path, store):
    from mlflow.tracking import MlflowClient

    r = train(tmp_path, store, "--set", "train_steps=40")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MLflow" not in r.stdout + r.stderr  # no warning
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    rid = run.info.run_id
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    params = run.data.params
    assert params["name"] == "tracked" and params["train_steps"] == "40"
    assert params["updater.lr"] == "0.05" and json.loads(params["model.layers"])[0]["units"] == 32
    kept = json.loads((tmp_path / "run" / "mlflow_run.json").read_text())
    assert kept["run_id"] == rid  # (and in the history, where it was known at a report)
    assert all(x["run_id"] == rid for x in records(tmp_path) if x["kind"] == "mlflow")
    # resumed from step 40 to 60: the same MLflow run
    r = train(tmp_path, store, "--resume")
    assert r.returncode == 0, r.stdout + r.stderr
    (again,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert again.info.run_id == rid and again.info.status == "FINISHED"
    for key, kind, field in (
        ("train/loss", "train", "loss"),
        ("eval/test_accuracy", "eval", "test_accuracy"),
    ):
        want = {x["step"]: x[field] for x in records(tmp_path) if x["kind"] == kind}
        got = {m.step: m.value for m in client.get_metric_history(rid, key)}
        assert got == pytest.approx(want) and max(want) == 60, key
    tags = again.data.tags
    steps = sorted(int(k.split("-")[1]) for k in tags if k.startswith("checkpoint.step-"))
    assert steps == [20, 40, 60], tags
    assert tags["checkpoint.latest"].endswith("step-60")
    assert float(tags["result.test_accuracy"]) > 0.5
    # started afresh: a new MLflow run
    r = train(tmp_path, store, "--fresh")
    assert r.returncode == 0, r.stdout + r.stderr
    ids = {x.info.run_id for x in client.search_runs([again.info.experiment_id])}
    assert len(ids) == 2 and rid in ids


def test_a_tracking_server_that_cannot_be_reached_is_one_warning(tmp_path, monkeypatch):
    # (raysinga's own retries and timeout: the environment sets neither)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    with socket.socket() as s:  # a port with nothing behind it, on loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "job.yaml").write_text(JOB)
    want = run_cli("train", str(plain / "job.yaml"), "--local", "--set", f"run_dir={plain / 'run'}")
    assert want.returncode == 0, want.stdout + want.stderr
    t0 = time.monotonic()
    r = train(tmp_path, f"http://127.0.0.1:{port}")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    warnings = [x for x in out.splitlines() if "MLflow" in x]
    assert len(warnings) == 1 and "cannot be reached" in warnings[0], out
    assert "the run goes on without MLflow" in warnings[0]
    last = want.stdout.strip().splitlines()[-1]
    assert last.startswith("final test accuracy") and last in r.stdout, (last, r.stdout)
    assert time.monotonic() - t0 < 120


LONG = (
    JOB.replace("train_steps: 60", "train_steps: 200")
    .replace("test_freq: 30", "test_freq: 50")
    .replace("checkpoint_frequency: 20", "checkpoint_frequency: 100")
)

# The driver, through the Python API in a process of its own: at the report of step 160 it
# says so in a file and waits there, with the checkpoint of step 100 its newest, to be killed.
DRIVER = """
import sys, time
from pathlib import Path
from raysinga import config
from raysinga.obs.events import TrainStep
from raysinga.run import Trainer

job, run, uri = sys.argv[1:]
cfg = config.load(job, [f"run_dir={run}", f"mlflow={{tracking_uri: '{uri}', experiment: e}}"])

def wait_at_160(ev):
    if isinstance(ev, TrainStep) and ev.step == 160:
        (Path(run) / "at-160").touch()
        time.sleep(600)

Trainer(cfg, log=print, on_event=wait_at_160).fit()
"""


def logged(client, rid: str, key: str, step: int, error: type) -> bool:
    """Whether MLflow run ``rid`` has ``key`` at ``step``, read while the run writes it."""
    try:
        return step in {m.step for m in client.get_metric_history(rid, key)}
    except (error, ValueError):  # a line of the file store being written
        return False


def test_a_sigkilled_driver_resumed_logs_each_step_once(tmp_path, store):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = store
    run = tmp_path / "run"
    job = tmp_path / "job.yaml"
    job.write_text(LONG)
    (tmp_path / "driver.py").write_text(DRIVER)
    cmd = [sys.executable, str(tmp_path / "driver.py"), str(job), str(run), uri]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "at-160").exists() or not (run / "mlflow_run.json").exists():
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, "the driver never reached step 160"
            time.sleep(0.05)
        rid = json.loads((run / "mlflow_run.json").read_text())["run_id"]
        client = MlflowClient(tracking_uri=uri)
        # MLflow holds the evaluation of step 150, past the checkpoint the resume starts from
        while not logged(client, rid, "eval/test_accuracy", 150, MlflowException):
            assert time.monotonic() < deadline, "MLflow never had the evaluation of step 150"
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGKILL)
        assert p.wait(timeout=30) == -signal.SIGKILL
    finally:
        p.kill()
        p.stdout.close()
    assert sorted(int(d.name[5:]) for d in (run / "checkpoints").glob("step-*")) == [100]
    assert max(m.step for m in client.get_metric_history(rid, "train/loss")) >= 150
    lines: list[str] = []  # resumed here, through the same API
    Trainer(tracked(job, run, uri), log=lines.append, resume=True).fit()
    assert any("resuming 'tracked' at step 100" in x for x in lines), lines
    assert not [x for x in lines if "MLflow" in x], lines
    want: dict[str, dict[int, float]] = {}
    for rec in records(tmp_path):
        for key, v in record_scalars(rec).items():
            want.setdefault(key, {})[rec["step"]] = v
    for key in client.get_run(rid).data.metrics:
        steps = [m.step for m in client.get_metric_history(rid, key)]
        assert len(steps) == len(set(steps)), (key, sorted(steps))
    for key in ("train/loss", "train/lr", "eval/test_accuracy", "eval/test_loss"):
        got = {m.step: m.value for m in client.get_metric_history(rid, key)}
        assert got == pytest.approx(want[key]) and max(got) == 200, key


def test_a_resume_that_changes_the_job_says_so_in_mlflow_and_in_one_warning(tmp_path, store):
    from mlflow.tracking import MlflowClient

    uri = store
    (tmp_path / "job.yaml").write_text(JOB)

    def fit(*more: str, resume: bool = False) -> list[str]:
        """The run's console lines that speak of MLflow."""
        lines: list[str] = []
        cfg = tracked(tmp_path / "job.yaml", tmp_path / "run", uri, *more)
        Trainer(cfg, log=lines.append, resume=resume).fit()
        return [x for x in lines if "MLflow" in x]

    assert fit("train_steps=40") == []
    (said,) = fit(resume=True)  # the job file's train_steps: 60
    assert "the resume changes train_steps (40 -> 60)" in said and "resume.1.train_steps" in said
    (said,) = fit("train_steps=80", "disp_freq=20", resume=True)
    assert "disp_freq (10 -> 20), train_steps (60 -> 80)" in said and "resume.2.<key>" in said
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert run.data.params["train_steps"] == "40"  # as first logged: MLflow keeps it
    assert {k: v for k, v in run.data.tags.items() if k.startswith("resume.")} == {
        "resume.1.step": "40",
        "resume.1.train_steps": "40 -> 60",
        "resume.2.step": "60",
        "resume.2.train_steps": "60 -> 80",
        "resume.2.disp_freq": "10 -> 20",
    }
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == [*range(10, 70, 10), 80]


def test_a_file_store_that_mlflow_refuses_is_named_as_such(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = f"file://{tmp_path / 'mlruns'}"
    (tmp_path / "job.yaml").write_text(JOB)
    lines: list[str] = []
    done = Trainer(tracked(tmp_path / "job.yaml", tmp_path / "run", uri), log=lines.append).fit()
    assert done.checkpoint_step == 60  # trained to its end
    (said,) = [x for x in lines if "MLflow" in x]
    assert f"MLflow refuses its file store at {uri}" in said, said
    assert "MLFLOW_ALLOW_FILE_STORE=true" in said and "http://" in said, said
    assert "cannot be reached" not in said and said.endswith("the run goes on without MLflow")
