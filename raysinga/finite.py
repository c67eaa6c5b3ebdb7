"""Non-finite values stop a run before they reach a checkpoint: the loss, the gradients' norm
and, at each checkpoint, every value saved."""

from __future__ import annotations

from typing import Any

import numpy as np


class NonFiniteLoss(FloatingPointError):
    """The loss (or the gradients' norm) became NaN or infinite: the run stops before a
    checkpoint can take the state it leads to, naming the likely cause."""

    def __init__(
        self,
        loss: float,
        step: int,
        group: int | None = None,
        what: str = "loss",
        first_step: int = 0,
    ) -> None:
        where = f"step {step}" if group is None else f"step {step} of group {group}"
        if step <= first_step:  # nothing trained yet: the inputs, not the optimizer
            cause = "likely the data: check it for NaN or infinite values"
        else:
            cause = "likely the learning rate: lower updater.lr or set updater.clip_norm"
        super().__init__(
            f"{what} is {loss} at {where}; the run stops, its last checkpoint is from before "
            f"({cause})"
        )
        self.step, self.group = step, group


class NonFiniteState(FloatingPointError):
    """A checkpoint was about to take NaN or infinite values: it is never committed."""


def first_nonfinite(named: Any, chunk: int = 1 << 20) -> str | None:
    """The name of the first array of ``named`` ((name, array) pairs) holding a NaN or an
    infinity, or None; checked in pieces, so the check allocates little whatever the size."""
    for name, a in named:
        flat = np.asarray(a).reshape(-1)
        if flat.dtype.kind != "f":
            continue
        for i in range(0, flat.size, chunk):
            if not np.isfinite(flat[i : i + chunk]).all():
                return name
    return None


def check_finite_state(named: Any, step: int) -> None:
    """Refuse to checkpoint a state that holds NaN or infinite values."""
    bad = first_nonfinite(named)
    if bad is not None:
        raise NonFiniteState(
            f"{bad} holds NaN or infinite values at step {step}: not checkpointed, the run "
            "stops (likely the learning rate: lower updater.lr or set updater.clip_norm)"
        )
