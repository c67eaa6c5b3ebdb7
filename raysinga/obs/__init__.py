"""What a run tells: the typed events the trainers emit and their subscribers (console lines,
the progress bar, ``metrics.jsonl``, TensorBoard event files), the result a run hands back, and
pictures of a run and of its net. Text is made here, at the edge, and never parsed back."""

from __future__ import annotations

from .events import Event, EventHub
from .metrics import TrainResult

__all__ = ["Event", "EventHub", "TrainResult"]
