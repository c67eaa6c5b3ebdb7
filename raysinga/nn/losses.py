"""Losses: each returns ``(loss, d_loss/d_output)``, the loss summed and divided by ``denom``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raysinga import kernels as K


def softmax_cross_entropy(logits: Any, labels: Any, denom: float) -> tuple[Any, Any]:
    """Fused softmax + cross-entropy on integer class labels."""
    if denom <= 0:
        raise ValueError(f"denom must be positive, got {denom}")
    return K.softmax_xent(logits, labels, denom)


def mean_squared_error(pred: Any, target: Any, denom: float) -> tuple[Any, Any]:
    """Squared error summed over outputs and batch, divided by ``denom * outputs``: with
    ``denom`` the batch size this is the mean over all elements (PyTorch's ``MSELoss``)."""
    if denom <= 0:
        raise ValueError(f"denom must be positive, got {denom}")
    target = target.reshape(pred.shape).astype(pred.dtype, copy=False)
    per = pred[0].size if len(pred) else 1
    diff = pred - target
    scale = pred.dtype.type(1.0 / (denom * per))
    return (diff * diff).sum() * scale, diff * (2 * scale)


def sequence_cross_entropy(logits: Any, labels: Any, denom: float) -> tuple[Any, Any]:
    """Softmax cross-entropy at every position: ``logits`` (N, T, V), integer ``labels``
    (N, T); summed over positions and batch, divided by ``denom * T``: with ``denom`` the
    batch size, the mean loss per token in nats (PyTorch's ``cross_entropy`` over all
    positions)."""
    if denom <= 0:
        raise ValueError(f"denom must be positive, got {denom}")
    n, t, v = logits.shape
    labels = labels.reshape(n * t)
    loss, d = K.softmax_xent(logits.reshape(n * t, v), labels, denom * t)
    return loss, d.reshape(n, t, v)


def accuracy(logits: Any, labels: Any) -> float:
    """Fraction of rows (or positions) whose largest logit is the label."""
    return float((logits.argmax(axis=-1) == labels.reshape(logits.shape[:-1])).mean())


LOSSES: dict[str, Callable[[Any, Any, float], tuple[Any, Any]]] = {
    "softmax_cross_entropy": softmax_cross_entropy,
    "sequence_cross_entropy": sequence_cross_entropy,
    "mse": mean_squared_error,
}
CLASSIFYING = ("softmax_cross_entropy", "sequence_cross_entropy")  # these have an accuracy
