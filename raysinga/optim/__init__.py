"""What turns gradients into updates: the optimizers (SGD, AdaGrad, RMSProp, Adam, AdamW), the
learning-rate schedules (the rate as a pure function of the global step), and the gradient
arithmetic the trainer, the stubs and the servers share (sums in a fixed order, the global norm,
clipping). On NumPy or CuPy arrays; nothing here needs Ray."""

from __future__ import annotations

from .grads import clip_grad_norm, global_grad_norm, sum_into
from .optimizers import Optimizer, make_optimizer
from .schedules import Schedule, make_schedule, schedule_from_state

__all__ = [
    "Optimizer",
    "Schedule",
    "clip_grad_norm",
    "global_grad_norm",
    "make_optimizer",
    "make_schedule",
    "schedule_from_state",
    "sum_into",
]
