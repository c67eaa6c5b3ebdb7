"""Gradient arithmetic shared by the trainer, the stubs and the servers: sums of several
gradients in a fixed order, the global L2 norm and clipping by it, and how a pass over large
arrays is split over threads."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from raysinga.kernels import get_array_module

PARALLEL_CHUNK = 1 << 18  # elements: below this per thread, threads cost more than they save
# elements: a summed update works through its operands in blocks this long, each block still
# in cache from one operation to the next (128 Ki measured fastest of 32 Ki to 256 Ki here)
BLOCK = 1 << 17


def chunks(size: int, pool: Any) -> list[tuple[int, int]]:
    """Contiguous ranges for a pool's threads (one range, i.e. no threading, for small sizes)."""
    threads = getattr(pool, "_max_workers", 1) if pool is not None else 1
    k = max(1, min(threads, size // PARALLEL_CHUNK))
    return [(size * i // k, size * (i + 1) // k) for i in range(k)]


def on_threads(pool: Any, fn: Callable[[Any], None], pieces: list[Any]) -> None:
    """``fn`` of every piece: the first on the calling thread, the others on ``pool``'s (one
    thread fewer to wake). Element-wise work gives the same bits however it is split."""
    later = [pool.submit(fn, piece) for piece in pieces[1:]]
    fn(pieces[0])
    for f in later:
        f.result()


def sum_into(out: np.ndarray, parts: list[np.ndarray]) -> None:
    """``out = parts[0] + parts[1] + ...``, added in the given order (whatever order the parts
    arrived in: a sum of floats depends on it)."""
    if len(parts) == 1:
        np.copyto(out, parts[0])
        return
    np.add(parts[0], parts[1], out=out)
    for x in parts[2:]:
        np.add(out, x, out=out)


def global_grad_norm(grads: dict) -> float:
    """L2 norm over all gradients, summed in float64 in name order (deterministic)."""
    total = 0.0
    for name in sorted(grads):
        g = grads[name]
        g64 = g.astype(get_array_module(g).float64, copy=False)
        total += float((g64 * g64).sum())  # NumPy sums pairwise: a fixed order
    return math.sqrt(total)


def clip_grad_norm(grads: dict, max_norm: float) -> float:
    """Scale all gradients in place so their global L2 norm is at most ``max_norm``; returns the
    norm before clipping. Same rule as torch.nn.utils.clip_grad_norm_: the factor is
    ``max_norm / (norm + 1e-6)``, applied only when it is below 1."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm > 0:
        raise ValueError(f"clip_grad_norm: max_norm must be a number > 0, got {max_norm!r}")
    norm = global_grad_norm(grads)
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for name in sorted(grads):
            grads[name] *= coef
    return norm


def clip_grad_norm_on_device(grads: dict, max_norm: float) -> Any:
    """:func:`clip_grad_norm` without reading anything back to the host (a step recorded as a
    CUDA graph cannot): the norm stays a 0-d float64 device array, and the factor, 1 where no
    clipping is due (``x * 1`` is ``x``), multiplies every gradient. The squares are summed in
    float64 in name order and the factor rounded to each gradient's dtype, as there."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm > 0:
        raise ValueError(f"clip_grad_norm: max_norm must be a number > 0, got {max_norm!r}")
    names = sorted(grads)
    xp = get_array_module(*(grads[n] for n in names))
    total = None
    for name in names:
        g64 = grads[name].astype(xp.float64, copy=False)
        square = (g64 * g64).sum()
        total = square if total is None else total + square
    norm = xp.sqrt(total)
    coef = max_norm / (norm + 1e-6)
    coef = xp.where(coef < 1, coef, 1.0)  # a NaN norm clips nothing, as clip_grad_norm
    for name in names:
        grads[name] *= coef.astype(grads[name].dtype)
    return norm
