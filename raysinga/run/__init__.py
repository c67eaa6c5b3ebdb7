"""One training run, whoever computes its steps: the session both trainers share (what a run
starts from, its writer lock, its checkpoints and their retention, the divergence guard, the
record next to the checkpoints, the object-store registry), what a training checkpoint holds, and
the single-process trainer, which is the exact reference the distributed one reproduces."""

from __future__ import annotations

from .divergence import Diverged
from .session import Preempted
from .trainer import Trainer

__all__ = ["Diverged", "Preempted", "Trainer"]
