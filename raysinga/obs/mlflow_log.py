"""A run tracked in MLflow (the job's ``mlflow`` section; the ``mlflow`` extra): the resolved job
as the MLflow run's parameters, every metric record by step (as in ``metrics.jsonl``, tagged
``<kind>/<field>``: ``train/loss``, ``eval/test_accuracy``), each committed checkpoint's step
and location as tags, and how the run ended.

Nothing of the training waits on MLflow. The subscriber hands what it logs to a thread of its
own through a bounded queue; where the queue is full (a slow tracking server), it drops the
newest and counts them, and says how many at the end. A tracking server that cannot be reached
gets one warning, and the run goes on without it; so does a ``file://`` store that MLflow 3
refuses (where ``MLFLOW_ALLOW_FILE_STORE`` is not ``true``), named as such.

A resumed run goes on in the same MLflow run. Its id is kept in the run directory
(``mlflow_run.json``, written once the MLflow run is made) and in the run's history (a record
``{"kind": "mlflow", "run_id": ...}``, which the checkpoints after it keep); a resume takes the
history's, else the file's. A run started afresh (``--fresh``) starts a new MLflow run.

MLflow cannot delete a metric's points, and a resume repeats the steps between its checkpoint and
the end of the start before (with the same values: a resume is exact). So a resume reads the
MLflow run's history once, and logs no point of a metric at a step the run already has.

MLflow's parameters cannot change either: a resume whose job differs from the one its checkpoint
was written under keeps them as they are, tags each change (``resume.<n>.<key>``: ``old -> new``,
beside ``resume.<n>.step``, the step it went on from) and says so in one warning.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .events import CheckpointCommitted, Event
from .tensorboard import record_scalars

QUEUE = 10_000  # items waiting for the thread, at most
PARAM_CHARS = 6000  # MLflow's longest parameter value
BATCH = 100  # parameters per call (MLflow's limit)
CLOSE_S = 10.0  # how long the end of a run waits for what is still queued
RUN_FILE = "mlflow_run.json"  # in the run directory: the MLflow run's id
TAG_CHARS = 8000  # MLflow's longest tag value
UNSET = "(unset)"  # a key a job does not give, in a resume's change
RESUME_TAG = re.compile(r"^resume\.(\d+)\.")
FILE_STORE_SWITCH = "MLFLOW_ALLOW_FILE_STORE"  # what MLflow 3 asks of a file:// store


@dataclass(frozen=True)
class MlflowRun(Event):
    """The run is tracked as MLflow run ``run_id``: kept in the history, so a resume finds it."""

    run_id: str
    step: int

    def record(self) -> dict[str, Any]:
        return {"kind": "mlflow", "step": self.step, "run_id": self.run_id}


def flat_params(job: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A job (the resolved YAML's dict) as MLflow parameters: dotted keys, scalar values as
    text, lists as JSON, every value cut to MLflow's length."""
    out: dict[str, str] = {}
    for k, v in job.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, key + "."))
        else:
            text = v if isinstance(v, str) else json.dumps(v, default=str)
            out[key] = text[:PARAM_CHARS]
    return out


def job_changes(before: dict[str, str], after: dict[str, str]) -> dict[str, tuple[str, str]]:
    """The parameters (:func:`flat_params`) that differ between two jobs: key -> (before,
    after), :data:`UNSET` where a job does not give the key."""
    keys = sorted(before.keys() | after.keys())
    pairs = {k: (before.get(k, UNSET), after.get(k, UNSET)) for k in keys}
    return {k: (a, b) for k, (a, b) in pairs.items() if a != b}


def resume_tags(n: int, step: int, changes: dict[str, tuple[str, str]]) -> dict[str, str]:
    """The tags of the run's ``n``-th resume, from ``step``, with its job's ``changes``."""
    half = (TAG_CHARS - len(" -> ")) // 2
    tags = {f"resume.{n}.step": str(step)}
    tags.update({f"resume.{n}.{k}": f"{a[:half]} -> {b[:half]}" for k, (a, b) in changes.items()})
    return tags


def changes_line(n: int, run_id: str, changes: dict[str, tuple[str, str]]) -> str:
    """The one console line that tells of a resume's changes to the job."""

    def short(v: str) -> str:
        return v if len(v) <= 40 else v[:37] + "..."

    listed = [f"{k} ({short(a)} -> {short(b)})" for k, (a, b) in list(changes.items())[:3]]
    more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
    what = "the change as tag" if len(changes) == 1 else "the changes as tags"
    key = next(iter(changes)) if len(changes) == 1 else "<key>"
    return (
        f"raysinga: warning: the resume changes {', '.join(listed)}{more}; MLflow run {run_id} "
        f"keeps the parameters it started with (MLflow cannot change them) and has {what} "
        f"resume.{n}.{key}"
    )


def resumed_run(history: Iterable[dict[str, Any]]) -> str | None:
    """The MLflow run id a run's history names last (None: none)."""
    ids = [r["run_id"] for r in history if r.get("kind") == "mlflow" and r.get("run_id")]
    return ids[-1] if ids else None


class MlflowLog:
    """The subscriber (:class:`~.events.EventHub`), and its thread. ``notice``: how a warning
    reaches the user (called from the run's thread, at its next event)."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        job: dict[str, Any],
        step: int,
        history: list[dict[str, Any]],
        notice: Callable[[str], None],
        emit: Callable[[Event], None],
        run_file: Path | None = None,
        resumed: bool = False,
        before: dict[str, Any] | None = None,
    ) -> None:
        """``before``: a resume's job as its checkpoint was written (its changes are tagged)."""
        self.uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.notice, self.emit, self.run_file = notice, emit, run_file
        self.run_id: str | None = resumed_run(history)
        self.announced = self.run_id is not None  # already in the history
        if self.run_id is None and resumed and run_file is not None:
            self.run_id = _kept(run_file)
        self.resuming = False
        self.resume_n = 0  # the MLflow run's resumes so far, this one included
        params = flat_params(job)
        self.changes = job_changes(flat_params(before), params) if before is not None else {}
        # a resume: each metric's steps the MLflow run already has, which it does not log again
        self.logged: dict[str, set[int]] = {}
        self.step = step
        self.dropped = 0
        self.warnings: list[str] = []
        self.broken = False
        self.q: queue.Queue = queue.Queue(QUEUE)
        self._put(("start", params))
        self.thread = threading.Thread(target=self._work, name="raysinga-mlflow", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the run's thread
    def __call__(self, ev: Event) -> None:
        rec = ev.record()
        # the id into the history with a record, where the metrics file surely listens
        self._tell(announce=rec is not None)
        if rec is None or isinstance(ev, MlflowRun):
            return
        step = rec.get("step")
        scalars = record_scalars(rec)
        if scalars and isinstance(step, int):
            self._put(("metrics", step, scalars, rec.get("time", time.time())))
        if isinstance(ev, CheckpointCommitted):
            self._put(
                ("tags", {f"checkpoint.step-{ev.step}": ev.path, "checkpoint.latest": ev.path})
            )

    def close(self, status: str, result: dict[str, Any] | None = None) -> None:
        """The run ended (``FINISHED``, ``FAILED`` or ``KILLED``): its final figures, and the
        MLflow run's end, sent; waits up to :data:`CLOSE_S` for the queue to drain."""
        if result:
            self._put(("tags", {f"result.{k}": str(v) for k, v in result.items()}))
        if not self.broken:  # the end waits for room: the MLflow run must be ended
            try:
                self.q.put(("end", status), timeout=CLOSE_S)
            except queue.Full:
                self.dropped += 1
        self.thread.join(CLOSE_S)
        self._tell()
        if self.thread.is_alive() and not self.broken:
            self.notice(
                f"raysinga: warning: MLflow at {self.uri} took more than {CLOSE_S:g} s to take "
                "the run's last records; some may be missing there"
            )
        if self.dropped:
            self.notice(
                f"raysinga: warning: {self.dropped} record(s) not logged to MLflow: its queue "
                "was full (the tracking server was slower than the run)"
            )

    def _put(self, item: tuple) -> None:
        if self.broken:
            return
        try:
            self.q.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def _tell(self, announce: bool = False) -> None:
        """On the run's thread: the warnings the MLflow thread left, and (``announce``) the
        MLflow run's id into the history once it is known."""
        while self.warnings:
            self.notice(self.warnings.pop(0))
        if announce and self.run_id is not None and not self.announced:
            self.announced = True
            self.emit(MlflowRun(self.run_id, self.step))

    # ------------------------------------------------------------------ the MLflow thread
    def _work(self) -> None:
        try:
            from mlflow.entities import Metric, Param, RunTag  # noqa: PLC0415
            from mlflow.tracking import MlflowClient  # noqa: PLC0415
        except ImportError:
            return self._give_up("MLflow is not installed (pip install 'raysinga[mlflow]')")
        # A server that does not answer: found in seconds, not after MLflow's minutes of
        # retries (where the user set neither, for this process)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        try:
            client = MlflowClient(tracking_uri=self.uri)
            run_id = self._open(client)
        except Exception as e:  # noqa: BLE001 - a tracking server down, a bad URI
            return self._give_up(unreachable(self.uri, e))
        while True:
            item = self.q.get()
            try:
                if item[0] == "start" and self.resuming:  # its parameters cannot change
                    tags = resume_tags(self.resume_n, self.step, self.changes)
                    tagged = [RunTag(k, v) for k, v in tags.items()]
                    for i in range(0, len(tagged), BATCH):
                        client.log_batch(run_id, tags=tagged[i : i + BATCH])
                    if self.changes:
                        self.warnings.append(changes_line(self.resume_n, run_id, self.changes))
                elif item[0] == "start":
                    params = [Param(k, v) for k, v in item[1].items()]
                    for i in range(0, len(params), BATCH):
                        client.log_batch(run_id, params=params[i : i + BATCH])
                elif item[0] == "metrics":
                    _, step, scalars, when = item
                    ms = int(when * 1000)
                    metrics = [
                        Metric(k, v, ms, step)
                        for k, v in scalars.items()
                        if step not in self.logged.get(k, ())
                    ]
                    if metrics:
                        client.log_batch(run_id, metrics=metrics)
                elif item[0] == "tags":
                    for k, v in item[1].items():
                        client.set_tag(run_id, k, v)
                elif item[0] == "end":
                    client.set_terminated(run_id, item[1])
                    return None
            except Exception as e:  # noqa: BLE001
                return self._give_up(f"MLflow at {self.uri} stopped taking records ({_line(e)})")

    def _open(self, client: Any) -> str:
        """The MLflow run: the one the history names, where it still exists; else a new one in
        the experiment (made where there is none)."""
        self.resuming = False
        if self.run_id is not None:
            try:
                run = client.get_run(self.run_id)
            except Exception:  # noqa: BLE001 - gone from the store: a new one
                self.announced = False
            else:
                client.update_run(self.run_id, status="RUNNING")
                self.logged = logged_steps(client, self.run_id, run.data.metrics)
                done = [int(m.group(1)) for k in run.data.tags if (m := RESUME_TAG.match(k))]
                self.resume_n = max(done, default=0) + 1
                self.resuming = True
                return self.run_id
        exp = client.get_experiment_by_name(self.experiment)
        eid = exp.experiment_id if exp else client.create_experiment(self.experiment)
        run = client.create_run(eid, run_name=self.run_name)
        self.run_id = run.info.run_id
        if self.run_file is not None:
            _keep(self.run_file, {"run_id": self.run_id, "tracking_uri": self.uri})
        return self.run_id

    def _give_up(self, why: str) -> None:
        self.broken = True
        self.warnings.append(f"raysinga: warning: {why}; the run goes on without MLflow")


def unreachable(uri: str, e: BaseException) -> str:
    """Why MLflow at ``uri`` could not be opened, from what its client raised."""
    if FILE_STORE_SWITCH in str(e):  # MLflow 3 keeps its file store for those who ask for it
        return (
            f"MLflow refuses its file store at {uri} (MLflow 3 opens one only where "
            f"{FILE_STORE_SWITCH}=true is set; else track to a server, http://HOST:5000, or, "
            "with the full mlflow package, a database, sqlite:///PATH/mlflow.db)"
        )
    return f"MLflow at {uri} cannot be reached ({_line(e)})"


def logged_steps(client: Any, run_id: str, keys: Iterable[str]) -> dict[str, set[int]]:
    """The steps of each metric ``keys`` names that MLflow run ``run_id`` holds."""
    return {k: {m.step for m in client.get_metric_history(run_id, k)} for k in keys}


def _keep(path: Path, what: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(what))
        os.replace(tmp, path)
    except OSError:  # the history keeps it too
        pass


def _kept(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
