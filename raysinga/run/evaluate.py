"""Evaluation of a net on held-out data: mean loss, accuracy and bits per token of each split,
in inference mode. The single-process trainer and a distributed group's first worker both call
it, so the two report the same figures of the same parameters."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from raysinga.data import Dataset
from raysinga.data.splits import Splits
from raysinga.nn.model import Net


def evaluate(
    net: Net,
    params: dict,
    state: dict,
    data: Dataset,
    batch_size: int,
    xp: Any,
    split: str = "test",
) -> dict[str, float]:
    """Mean loss and accuracy over a whole data set, in inference mode, named for ``split``
    (``test_loss``, ``valid_accuracy``, ...)."""
    total_loss, correct, n = 0.0, 0.0, len(data)
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        x, y = data.get(idx)
        loss, acc = net.evaluate(params, state, net.prepare_input(x, xp), xp.asarray(y))
        total_loss += loss * len(idx)
        correct += (acc or 0.0) * len(idx)
    out = {f"{split}_loss": total_loss / n}
    if net.classifies:
        out[f"{split}_accuracy"] = correct / n
    if net.spec.loss == "sequence_cross_entropy":
        out[f"{split}_bits"] = out[f"{split}_loss"] / math.log(2)  # per token
    return out


def evaluate_splits(
    net: Net, params: dict, state: dict, splits: Splits, batch_size: int, xp: Any
) -> dict[str, float]:
    """:func:`evaluate` on each held-out split (validation, test), in one mapping."""
    out: dict[str, float] = {}
    for name, data in splits.held_out().items():
        out.update(evaluate(net, params, state, data, batch_size, xp, name))
    return out
