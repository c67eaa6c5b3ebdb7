"""A run tracked in MLflow (the job's ``mlflow``; raysinga/obs/mlflow_log.py), read back with
MLflow's own client from a local file store: the resolved job as parameters, the metrics by
step as ``metrics.jsonl`` has them, each checkpoint as a tag, and after ``--resume`` the same
MLflow run. A tracking server that cannot be reached: the same training, one warning."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from helpers import run_cli

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
