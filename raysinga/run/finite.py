"""Non-finite values never reach a checkpoint: at each checkpoint, every value saved is checked
(the loss and the gradients' norm are the divergence guard's, :mod:`raysinga.run.divergence`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


class NonFiniteState(FloatingPointError):
    """A checkpoint was about to take NaN or infinite values: it is never committed."""


def first_nonfinite(
    named: Any, chunk: int = 1 << 20, pace: Callable[[], None] | None = None
) -> str | None:
    """The name of the first array of ``named`` ((name, array) pairs) holding a NaN or an
    infinity, or None; checked in pieces, so the check allocates little whatever the size
    (``pace()``, if given, is called before each)."""
    for name, a in named:
        flat = np.asarray(a).reshape(-1)
        if flat.dtype.kind != "f":
            continue
        for i in range(0, flat.size, chunk):
            if pace is not None:
                pace()
            if not np.isfinite(flat[i : i + chunk]).all():
                return name
    return None


def check_finite_state(named: Any, step: int, pace: Callable[[], None] | None = None) -> None:
    """Refuse to checkpoint a state that holds NaN or infinite values (``pace``: see
    :func:`first_nonfinite`)."""
    bad = first_nonfinite(named, pace=pace)
    if bad is not None:
        raise NonFiniteState(
            f"{bad} holds NaN or infinite values at step {step}: not checkpointed, the run "
            "stops (likely the learning rate: lower updater.lr or set updater.clip_norm)"
        )
