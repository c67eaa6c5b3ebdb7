"""What a run reports, as typed events, and who listens.

The trainers never write text: they emit the events below on an :class:`EventHub`. Subscribers
turn them into what a user sees or keeps, each at its own edge: console lines and the progress
bar (:mod:`.console`, :mod:`.progress`), ``metrics.jsonl`` and TensorBoard files
(:class:`.metrics.MetricsLog`), and hooks given by tests, examples and benchmarks (a fault
injected "at step 15" waits for ``TrainStep(step=15)``, never for a line of text).

An event that belongs in the run's metrics has a ``record()``: the dict written to
``metrics.jsonl`` and kept in the checkpoint's history; the others return None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


class Event:
    """Base of every event; ``record()`` is None unless the event is a metric."""

    def record(self) -> dict[str, Any] | None:
        return None


@dataclass(frozen=True)
class Notice(Event):
    """A message for the user (what the run starts from, a fallback, a warning)."""

    text: str


@dataclass(frozen=True)
class RunStarted(Event):
    """Training (re)starts: where, and with what shape."""

    name: str
    where: str  # "cpu", "gpu", or "Ray: <preset>, N server(s), ..."
    total: int  # steps (per group)
    step: int  # the step it starts from


@dataclass(frozen=True)
class TrainStep(Event):
    """Training has reached ``step`` (of ``total``); means over the steps since the last one."""

    step: int
    total: int
    epoch: int
    loss: float
    lr: float
    samples_per_s: float
    grad_norm: float | None = None
    ms: dict[str, float] | None = None  # mean time per step and phase (distributed runs)
    # bytes in and out of each host per step (distributed runs over several hosts): host name
    # -> {"in": bytes, "out": bytes}, counted from what the roles hand one another
    net: dict[str, dict[str, int]] | None = None

    def record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "kind": "train",
            "step": self.step,
            "epoch": self.epoch,
            "loss": self.loss,
            "lr": self.lr,
            "samples_per_s": self.samples_per_s,
        }
        if self.grad_norm is not None:
            rec["grad_norm"] = self.grad_norm
        if self.ms is not None:
            rec["ms"] = dict(self.ms)
        if self.net:
            rec["net"] = {h: dict(v) for h, v in self.net.items()}
        return rec


@dataclass(frozen=True)
class Evaluated(Event):
    """The held-out splits were evaluated at ``step``: ``metrics`` holds test_loss (and
    test_accuracy for classifiers, test_bits for language models), and the same as valid_*
    for the validation split (``data.validation``)."""

    step: int
    total: int
    metrics: dict[str, float]

    def record(self) -> dict[str, Any]:
        return {"kind": "eval", "step": self.step, **self.metrics}


@dataclass(frozen=True)
class CheckpointCommitted(Event):
    """The checkpoint of ``step`` is committed at ``path``. ``blocked_s``: how long training
    waited for it; ``seconds``: from its start to its commit."""

    step: int
    path: str
    blocked_s: float
    seconds: float
    in_background: bool  # written while training went on (the distributed trainer's servers)

    def record(self) -> dict[str, Any]:
        return {
            "kind": "checkpoint",
            "step": self.step,
            "blocked_ms": round(self.blocked_s * 1e3, 3),
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True)
class RoleLost(Event):
    """A role (or its node, or an object it held) was lost at ``step``; ``count`` of at most
    ``limit`` failures. The run recovers; a :class:`Recovered` follows. ``chunk``: the steps
    (from, to) its group was running when the loss was noticed, where it was running some
    (``step`` is the last the driver heard of; the group may have gone further)."""

    step: int
    role: str
    index: int | None
    group: int | None
    error: str
    count: int
    limit: int
    chunk: tuple[int, int] | None = None


@dataclass(frozen=True)
class Recovered(Event):
    """The run recovered from a loss; ``info`` is the failure record the run's history keeps
    (step, role, error, when it died, where training resumed, steps redone, seconds, sizes)."""

    info: dict[str, Any] = field(hash=False)

    @property
    def steps_redone(self) -> int:
        return int(self.info["steps_redone"])

    def record(self) -> dict[str, Any]:
        return dict(self.info)


@dataclass(frozen=True)
class Resized(Event):
    """An elastic run grew into room the cluster has again; ``info`` as in the history."""

    info: dict[str, Any] = field(hash=False)

    def record(self) -> dict[str, Any]:
        return dict(self.info)


@dataclass(frozen=True)
class StateChanged(Event):
    """The distributed controller moved into ``state`` (see
    :mod:`raysinga.distributed.controller`) with the furthest group at ``step``."""

    state: str
    step: int


Subscriber = Callable[[Event], None]


class EventHub:
    """Hands every event to each subscriber, in order of subscription. A subscriber that
    raises stops the run (a test hook may raise on purpose)."""

    def __init__(self, subscribers: Iterable[Subscriber] = ()) -> None:
        self.subscribers: list[Subscriber] = list(subscribers)

    def subscribe(self, fn: Subscriber, first: bool = False) -> Callable[[], None]:
        """Add ``fn`` (``first``: ahead of the others, e.g. the metrics file, so that a hook
        sees a record already written); returns the function that removes it again."""
        self.subscribers.insert(0 if first else len(self.subscribers), fn)
        return lambda: self.subscribers.remove(fn)

    def emit(self, event: Event) -> None:
        for fn in list(self.subscribers):
            fn(event)

    def notice(self, text: str) -> None:
        self.emit(Notice(text))
