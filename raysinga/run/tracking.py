"""A run tracked in MLflow where its job asks (``mlflow``): the subscriber made as the run
starts, in the MLflow run its history names where it goes on from a checkpoint, and ended with
the run (:mod:`raysinga.obs.mlflow_log`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from raysinga.checkpoint import storage
from raysinga.obs.events import EventHub


def track(cfg: Any, start: Any, hub: EventHub) -> Callable[[Any, bool, Any], None] | None:
    """The run's MLflow subscriber, subscribed to ``hub``; None where the job has no
    ``mlflow``. ``start``: how the run starts (:class:`~.session.Start`). Returns what ends it
    as the run ended: ``end(exc, killed, final)`` (``exc``: what the run raised, or None;
    ``killed``: it was a stop signal; ``final``: the last evaluation's figures), which
    unsubscribes it and ends the MLflow run finished, failed or killed."""
    m = cfg.mlflow
    if m is None:
        return None
    from raysinga.obs.mlflow_log import RUN_FILE, MlflowLog  # noqa: PLC0415

    info = start.info if start.resumed and start.info else {}
    history = info.get("history", [])
    step = start.checkpoint.step if start.resumed and start.checkpoint is not None else 0
    log = MlflowLog(
        m.tracking_uri,
        m.experiment,
        m.run_name or cfg.name,
        storage.redact_all(cfg.raw),
        step,
        history,
        hub.notice,
        hub.emit,
        Path(cfg.run_path) / RUN_FILE,
        start.resumed,
        info.get("config"),  # the job the checkpoint was written under: a resume's changes
    )
    remove = hub.subscribe(log)

    def end(exc: BaseException | None, killed: bool, final: dict | None) -> None:
        remove()
        log.close("KILLED" if killed else "FINISHED" if exc is None else "FAILED", final)

    return end
