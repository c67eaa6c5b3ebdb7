"""The distributed trainer: the controller (a state machine whose states decide and whose loop
executes), the groups of roles it places and wires, the chunks of steps it hands the stubs,
checkpoints written by the servers and committed by the driver, and recovery that replaces only
what was lost. The roles themselves are :mod:`raysinga.actors`."""

from __future__ import annotations

from .failures import FailuresExceeded
from .trainer import DistributedTrainer

__all__ = ["DistributedTrainer", "FailuresExceeded"]
