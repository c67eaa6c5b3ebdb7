"""What gradients and values cross between roles as (``topology.wire``), and a block's sum.

With ``topology.reduce: hosts`` the workers of each block (``workers_per_host`` of them, placed
on one host) are summed by the block's first worker, its leader, in worker order; the blocks'
sums of each server's slices meet at that server, which sums them in block order. So the order
of every addition is fixed by the job, not by where Ray placed the blocks: two runs give the
same bits, on one host or on many.

``wire: bf16`` rounds each block's sum and each server's published values to bfloat16 (to
nearest, ties to even) before they leave their role, and a reader on the same node as the
server rounds the values it reads alike: the bits do not depend on which reads crossed a link.
The servers keep float32 values and optimizer state, and sum the blocks in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from raysinga.kernels.precision import bf16_bits, from_bf16_bits

from .buffers import Layout

WIRE_DTYPE = {"f32": "float32", "bf16": "uint16"}  # bf16 travels as its 16-bit words


def wire_layout(layout: Layout, wire: str) -> Layout:
    """``layout`` (float32 arrays) as it crosses under ``wire``: the same names and shapes,
    each as float32 or as bfloat16 words."""
    dtype = WIRE_DTYPE[wire]
    return Layout.of({e.name: (e.shape, dtype) for e in layout.entries})


def encode(arrays: dict[str, np.ndarray], layout: Layout) -> np.ndarray:
    """One buffer laid out by ``layout`` (a :func:`wire_layout`) holding float32 ``arrays``
    by name, rounded to bfloat16 where the layout says so."""
    out = np.zeros(layout.nbytes, np.uint8)
    views = layout.views(out)
    for e in layout.entries:
        src = arrays[e.name]
        if e.dtype == "uint16":
            views[e.name][...] = bf16_bits(src).reshape(e.shape)
        else:
            views[e.name][...] = src
    return out


def decode(buf: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
    """Float32 arrays by name from a buffer laid out by ``layout`` (a :func:`wire_layout`):
    views where it is float32 already, exact conversions of bfloat16 words otherwise."""
    views = layout.views(buf)
    return {
        e.name: from_bf16_bits(views[e.name]).reshape(e.shape)
        if e.dtype == "uint16"
        else views[e.name]
        for e in layout.entries
    }


def rounded(values: dict[str, np.ndarray], wire: str) -> dict[str, np.ndarray]:
    """``values`` as a reader gets them under ``wire``: as they are (``f32``), or rounded to
    bfloat16 (new float32 arrays)."""
    if wire == "f32":
        return values
    return {k: from_bf16_bits(bf16_bits(v)).reshape(v.shape) for k, v in values.items()}


def blocks(n_workers: int, per_block: int) -> list[list[int]]:
    """The workers of each block, in order: ``[[0, 1], [2, 3]]`` for 4 workers by 2."""
    return [list(range(b, min(b + per_block, n_workers))) for b in range(0, n_workers, per_block)]


def sum_blocks(out: np.ndarray, parts: Sequence[np.ndarray]) -> None:
    """``out = parts[0] + parts[1] + ...`` in block order (a server's sum of the blocks)."""
    np.copyto(out, parts[0])
    for x in parts[1:]:
        np.add(out, x, out=out)
