"""The divergence guard, for every trainer and topology.

A run stops with one line naming the step, the loss, the learning rate and the topology when a
loss (or a gradient norm) turns NaN or infinite, or when the mean loss of its last steps rises
above ``divergence.factor`` times its early level: the mean loss of its first
``divergence.early_steps`` steps, and for a classifier at least the loss of a uniform guess
(ln of its classes), so that a run that starts well below that level is not stopped by a rise a
trained model's noise can make. The checkpoints committed after the divergence began (after the
newest step whose loss was at most the early level) are then set aside, so the newest
checkpoint from before it is the one ``--resume`` takes (:meth:`RunSession.__exit__`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raysinga.config.job import DivergenceConfig
from raysinga.nn.losses import CLASSIFYING
from raysinga.obs.events import Event


def chance_loss(loss: str, output_shape: tuple[int, ...]) -> float | None:
    """The loss of a uniform guess over a classifier's classes; None for a regression."""
    if loss in CLASSIFYING and output_shape[-1] > 1:
        return math.log(output_shape[-1])
    return None


@dataclass(frozen=True)
class EarlyLevel(Event):
    """The guard's early level, fixed after the run's first steps; kept in the run's history,
    so that a resumed or forked run is checked against the level of its first start."""

    step: int
    loss: float

    def record(self) -> dict[str, Any]:
        return {"kind": "guard", "step": self.step, "early_loss": self.loss}


class Diverged(FloatingPointError):
    """The run diverged at ``step``: it stops. ``safe``: the newest step whose state is taken
    as from before the divergence; :attr:`kept` says which checkpoint ``--resume`` now takes."""

    def __init__(self, head: str, step: int, safe: int, cause: str) -> None:
        super().__init__(head)
        self.head, self.step, self.safe, self.cause = head, step, safe, cause
        self.kept = "its checkpoints are as they were"

    def __str__(self) -> str:
        return f"{self.head}; the run stops, {self.kept} ({self.cause})"


# What a guard says of the run where it diverged: the learning rate at a step, and the topology.
Where = Callable[[int], tuple[float, str]]


class Guard:
    """Checks each step's loss as it is reported (every group's, in a distributed run)."""

    def __init__(
        self,
        cfg: DivergenceConfig,
        history: list[dict[str, Any]],
        first: list[int],
        chance: float | None,
        where: Where,
        batch: int,
        async_rule: bool = False,
    ) -> None:
        """``first``: each group's first step in this start; ``where``: the learning rate at a
        step, and the topology; ``batch``: the samples of a step's loss (a group's);
        ``async_rule``: name ``updater.async_lr`` in the advice."""
        self.cfg, self.first, self.chance, self.where = cfg, list(first), chance, where
        self.async_rule = async_rule
        self.safe_steps = list(first)  # per group: the start is from before any divergence
        levels = [r["early_loss"] for r in history if r.get("kind") == "guard"]
        self.early: float | None = levels[-1] if levels else None
        self.sum, self.n = 0.0, 0  # the early steps seen so far, while the level is not fixed
        self.batch = batch
        self.recent: deque[float] = deque(maxlen=-(-cfg.window // batch))

    @property
    def safe(self) -> int:
        """The newest step from before any divergence, in every group."""
        return min(self.safe_steps)

    @property
    def level(self) -> float | None:
        return self.early if self.early is not None else (self.sum / self.n if self.n else None)

    def observe(
        self, step: int, loss: float, grad_norm: float | None = None, group: int = 0
    ) -> EarlyLevel | None:
        """Check the loss of ``step`` (steps done before it); raise :class:`Diverged`, or
        return the early level once it is fixed (an event for the run's history)."""
        for what, v in (("loss", loss), ("gradient norm", grad_norm)):
            if v is not None and not math.isfinite(v):
                first = step <= self.first[group]  # nothing trained yet: the inputs
                raise self._diverged(f"{what} is {v}", step, group, first)
        self.recent.append(loss)
        level = self.level
        if level is not None and self.cfg.factor is not None:
            mean = sum(self.recent) / len(self.recent)
            bound = self.cfg.factor * max(level, self.chance or 0.0)
            if mean > bound:
                over = "its early level" if level >= (self.chance or 0.0) else "the chance level"
                head = (
                    f"loss is {mean:.4g} (the mean over the last {len(self.recent) * self.batch} "
                    f"samples), over {self.cfg.factor:g}x {over} "
                    f"{max(level, self.chance or 0.0):.4g}"
                )
                raise self._diverged(head, step, group, False)
        if level is None or loss <= level:
            self.safe_steps[group] = max(self.safe_steps[group], step)
        if self.early is not None:
            return None
        self.sum, self.n = self.sum + loss, self.n + 1
        if self.n < self.cfg.early_steps * len(self.first):
            return None
        self.early = self.sum / self.n
        return EarlyLevel(step + 1, self.early)

    def _diverged(self, head: str, step: int, group: int, first: bool) -> Diverged:
        lr, topology = self.where(step)
        at = f"step {step}" if len(self.first) == 1 else f"step {step} of group {group}"
        if first:
            cause = "likely the data: check it for NaN or infinite values"
        else:
            cause = "likely the learning rate: lower updater.lr and start over, or set "
            cause += "updater.async_lr: groups" if self.async_rule else "updater.clip_norm"
            cause += " and resume (a resume keeps the checkpoint's optimizer, but applies that)"
        head = f"{head} at {at}: the run diverged (learning rate {lr:.4g}, {topology})"
        return Diverged(head, step, self.safe, cause)


def describe_topology(topo: Any) -> str:
    """The topology, as a divergence message names it."""
    if topo is None:
        return "one process"
    return (
        f"{topo.preset}: {topo.n_groups} group(s) x {topo.workers_per_group} worker(s), "
        f"{topo.n_servers} server(s)"
    )
