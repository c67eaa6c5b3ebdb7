"""Where a run's metric records go: the result's history, ``metrics.jsonl`` and (optionally)
TensorBoard event files. :class:`MetricsLog` subscribes to the run's events while its loop runs
and keeps every event that has a record (:meth:`raysinga.obs.events.Event.record`)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .events import Event, EventHub
from .tensorboard import EventWriter


@dataclass
class TrainResult:
    """What a run hands back: the final parameters and state (where gathered), every record of
    ``metrics.jsonl`` in ``history``, the newest checkpoint (``checkpoint``: its path or URI,
    ``checkpoint_step``; ``None`` where the run left none) and, for a run started with
    ``init_from``, the report of what matched (:class:`~raysinga.checkpoint.MatchReport`).
    With ``checkpoint.keep_best``, ``best`` is the kept best checkpoint: its step, metric,
    value and path or URI."""

    params: dict[str, np.ndarray]
    state: dict[str, np.ndarray]
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str | None = None
    checkpoint_step: int | None = None
    init_report: Any = None
    best: dict[str, Any] | None = None

    @property
    def final_eval(self) -> dict[str, Any] | None:
        evals = [r for r in self.history if r["kind"] == "eval"]
        return evals[-1] if evals else None


class MetricsLog:
    """Records go to the result's history and, one JSON object a line, to
    ``<run_dir>/metrics.jsonl``, flushed at once so a crash loses nothing already reported;
    with ``tensorboard``, also to an event file in ``<run_dir>/tensorboard``."""

    def __init__(self, run_dir: Path, result: TrainResult, tensorboard: bool = False) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.result, self.file = result, (run_dir / "metrics.jsonl").open("w")
        self.events = EventWriter(run_dir) if tensorboard else None
        for rec in result.history:  # a resumed run's records so far
            self._write(rec)

    def _write(self, rec: dict[str, Any]) -> None:
        # NaN and infinity are not JSON: a reader of metrics.jsonl gets null instead.
        self.file.write(json.dumps(_finite_or_null(rec), allow_nan=False) + "\n")
        self.file.flush()
        if self.events is not None:
            self.events.record(rec)

    def record(self, rec: dict[str, Any]) -> None:
        self.result.history.append(rec)
        self._write(rec)

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()
        if self.events is not None:
            self.events.close()

    def __call__(self, ev: Event) -> None:
        rec = ev.record()
        if rec is not None:
            self.record(rec)


@contextlib.contextmanager
def recording(
    hub: EventHub, run_dir: Path, result: TrainResult, tensorboard: bool = False
) -> Iterator[MetricsLog]:
    """Keep the run's metric events in ``result`` and its files while the block runs."""
    with MetricsLog(run_dir, result, tensorboard) as metrics:
        remove = hub.subscribe(metrics, first=True)
        try:
            yield metrics
        finally:
            remove()


def _finite_or_null(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite_or_null(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite_or_null(x) for x in v]
    return v
