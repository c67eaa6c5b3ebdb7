"""Learning-rate schedules: the learning rate as a pure function of the global step.

A schedule holds only hyperparameters, never a counter: the rate at step N is computed from N, so
resuming from a checkpoint at step N gives the same rates as never stopping, and every server asks
the same schedule for the same step without talking to the others. Steps are 0-based.

Kinds (SINGA's names where they exist):

- ``fixed(lr)``
- ``step(lr, gamma, step_size)``: ``lr * gamma ** (step // step_size)``
- ``multistep(lr, gamma, milestones)``: ``lr * gamma ** (number of milestones <= step)``
  (SINGA's piecewise "fixedstep", torch's MultiStepLR)
- ``exponential(lr, gamma)``: ``lr * gamma ** step``
- ``linear(lr, final_lr, steps)``: linear from ``lr`` to ``final_lr`` over ``steps``, then flat
- ``inverse(lr, gamma, power)``: ``lr * (1 + gamma * step) ** -power`` (SINGA kInverse)
- ``cosine(lr, steps, min_lr=0)``: cosine annealing to ``min_lr`` over ``steps``, then flat
- ``warmup(steps, after, start_factor=0)``: linear ramp from ``start_factor * after(0)`` to
  ``after(steps)`` over ``steps``, then ``after(step)``. ``after`` is NOT offset by the warm-up:
  it sees the global step, so milestones and cosine lengths in a config are global steps and do
  not move when the warm-up length changes. (torch's SequentialLR restarts the second scheduler
  at the milestone; to get that, shorten ``after``'s milestones yourself.)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, ClassVar


def _number(kind: str, key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"schedule {kind!r}: {key} must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"schedule {kind!r}: {key} must be finite, got {v!r}")
    return v


def _nonneg(kind: str, key: str, v: Any) -> float:
    v = _number(kind, key, v)
    if v < 0:
        raise ValueError(f"schedule {kind!r}: {key} must be >= 0, got {v!r}")
    return v


def _positive(kind: str, key: str, v: Any) -> float:
    v = _number(kind, key, v)
    if v <= 0:
        raise ValueError(f"schedule {kind!r}: {key} must be > 0, got {v!r}")
    return v


def _count(kind: str, key: str, v: Any, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"schedule {kind!r}: {key} must be an integer, got {v!r}")
    if v < minimum:
        raise ValueError(f"schedule {kind!r}: {key} must be >= {minimum}, got {v!r}")
    return int(v)


class Schedule:
    """Base class: subclasses are dataclasses whose fields are exactly the hyperparameters."""

    kind: ClassVar[str] = ""

    def __call__(self, step: int) -> float:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        return float(self._lr(int(step)))

    def _lr(self, step: int) -> float:
        raise NotImplementedError

    def state_dict(self) -> dict:
        d: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            d[f.name] = v.state_dict() if isinstance(v, Schedule) else _plain(v)
        return d

    def load_state_dict(self, d: dict) -> None:
        if not isinstance(d, dict) or d.get("kind") != self.kind:
            got = d.get("kind") if isinstance(d, dict) else d
            raise ValueError(f"cannot load a {got!r} schedule into a {self.kind!r} schedule")
        # Build (and so validate) a fresh instance first: a bad dict leaves self unchanged.
        self.__dict__.update(schedule_from_state(d).__dict__)


def _plain(v: Any) -> Any:
    # msgpack-friendly: tuples become lists, numbers stay Python numbers.
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


@dataclasses.dataclass
class Fixed(Schedule):
    kind: ClassVar[str] = "fixed"
    lr: float

    def __post_init__(self) -> None:
        self.lr = _nonneg(self.kind, "lr", self.lr)

    def _lr(self, step: int) -> float:
        return self.lr


@dataclasses.dataclass
class Step(Schedule):
    kind: ClassVar[str] = "step"
    lr: float
    gamma: float
    step_size: int

    def __post_init__(self) -> None:
        self.lr = _nonneg(self.kind, "lr", self.lr)
        self.gamma = _positive(self.kind, "gamma", self.gamma)
        self.step_size = _count(self.kind, "step_size", self.step_size)

    def _lr(self, step: int) -> float:
        return self.lr * self.gamma ** (step // self.step_size)


@dataclasses.dataclass
class MultiStep(Schedule):
    kind: ClassVar[str] = "multistep"
    lr: float
    gamma: float
    milestones: list

    def __post_init__(self) -> None:
        self.lr = _nonneg(self.kind, "lr", self.lr)
        self.gamma = _positive(self.kind, "gamma", self.gamma)
        if not isinstance(self.milestones, (list, tuple)) or not self.milestones:
            raise ValueError(f"schedule {self.kind!r}: milestones must be a non-empty list")
        ms = [_count(self.kind, "milestones", m) for m in self.milestones]
        if any(b <= a for a, b in zip(ms[:-1], ms[1:], strict=True)):
            raise ValueError(
                f"schedule {self.kind!r}: milestones must be strictly increasing, got {ms}"
            )
        self.milestones = ms

    def _lr(self, step: int) -> float:
        passed = sum(1 for m in self.milestones if m <= step)
        return self.lr * self.gamma**passed


@dataclasses.dataclass
class Exponential(Schedule):
    kind: ClassVar[str] = "exponential"
    lr: float
    gamma: float

    def __post_init__(self) -> None:
        self.lr = _nonneg(self.kind, "lr", self.lr)
        self.gamma = _positive(self.kind, "gamma", self.gamma)

    def _lr(self, step: int) -> float:
        return self.lr * self.gamma**step


@dataclasses.dataclass
class Linear(Schedule):
    kind: ClassVar[str] = "linear"
    lr: float
    final_lr: float
    steps: int

    def __post_init__(self) -> None:
        self.lr = _nonneg(self.kind, "lr", self.lr)
        self.final_lr = _nonneg(self.kind, "final_lr", self.final_lr)
        self.steps = _count(self.kind, "steps", self.steps)

    def _lr(self, step: int) -> float:
        return self.lr + (self.final_lr - self.lr) * min(step, self.steps) / self.steps


@dataclasses.dataclass
class Inverse(Schedule):
    kind: ClassVar[str] = "inverse"
    lr: float
    gamma: float
    power: float

    def __post_init__(self) -> None:
        self.lr = _nonneg(self.kind, "lr", self.lr)
        self.gamma = _positive(self.kind, "gamma", self.gamma)
        self.power = _nonneg(self.kind, "power", self.power)

    def _lr(self, step: int) -> float:
        return self.lr * (1.0 + self.gamma * step) ** (-self.power)


@dataclasses.dataclass
class Cosine(Schedule):
    kind: ClassVar[str] = "cosine"
    lr: float
    steps: int
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        self.lr = _nonneg(self.kind, "lr", self.lr)
        self.steps = _count(self.kind, "steps", self.steps)
        self.min_lr = _nonneg(self.kind, "min_lr", self.min_lr)

    def _lr(self, step: int) -> float:
        t = min(step, self.steps) / self.steps
        return self.min_lr + (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * t)) / 2.0


@dataclasses.dataclass
class Warmup(Schedule):
    kind: ClassVar[str] = "warmup"
    steps: int
    after: Any  # a spec on input, a Schedule once built
    start_factor: float = 0.0

    def __post_init__(self) -> None:
        self.steps = _count(self.kind, "steps", self.steps)
        self.after = make_schedule(self.after)
        f = _nonneg(self.kind, "start_factor", self.start_factor)
        if f > 1:
            raise ValueError(f"schedule 'warmup': start_factor must be <= 1, got {f!r}")
        self.start_factor = f

    def _lr(self, step: int) -> float:
        if step >= self.steps:
            return self.after(step)
        start = self.start_factor * self.after(0)
        return start + (self.after(self.steps) - start) * step / self.steps


KINDS: dict[str, type[Schedule]] = {
    c.kind: c for c in (Fixed, Step, MultiStep, Exponential, Linear, Inverse, Cosine, Warmup)
}


def _from_dict(d: dict, what: str) -> Schedule:
    if not isinstance(d, dict):
        raise TypeError(f"{what} must be a dict, got {type(d).__name__}")
    kind = d.get("kind")
    if kind not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; allowed kinds: {', '.join(KINDS)}")
    cls = KINDS[kind]
    fields = dataclasses.fields(cls)
    allowed = {f.name for f in fields}
    args = {k: v for k, v in d.items() if k != "kind"}
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} for schedule {kind!r}; allowed: {sorted(allowed)}"
        )
    required = {f.name for f in fields if f.default is dataclasses.MISSING}
    missing = sorted(required - set(args))
    if missing:
        raise ValueError(f"schedule {kind!r} is missing required key(s) {missing}")
    return cls(**args)


def make_schedule(spec: float | dict | Schedule) -> Schedule:
    """A schedule from a number (fixed rate), a dict with a "kind", or a Schedule (as is)."""
    if isinstance(spec, Schedule):
        return spec
    if isinstance(spec, numbers.Real) and not isinstance(spec, bool):
        return Fixed(lr=spec)
    if isinstance(spec, dict):
        return _from_dict(spec, "schedule spec")
    raise TypeError(
        f"a learning-rate schedule must be a number, a dict or a Schedule, got {spec!r}"
    )


def schedule_from_state(d: dict) -> Schedule:
    """The schedule a ``state_dict()`` describes."""
    return _from_dict(d, "schedule state")
