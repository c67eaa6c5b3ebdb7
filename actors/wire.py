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

from raysinga.kernels.precision import bf16_bits, from_bf16_bits, round_bf16

from .buffers import Layout


def wire_bytes(layout: Layout, wire: str) -> int:
    """The bytes of float32 arrays laid out by ``layout`` as they cross under ``wire``."""
    n = sum(e.nbytes for e in layout.entries)
    return n if wire == "f32" else n // 2


def encode(arrays: Sequence[np.ndarray], wire: str) -> list[np.ndarray]:
    """Float32 ``arrays`` as they cross under ``wire``: as they are (Ray copies each into its
    object store once, as it puts the list), or rounded to bfloat16 words."""
    if wire == "f32":
        return list(arrays)
    return [bf16_bits(a) for a in arrays]


def decode(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Float32 arrays from what :func:`encode` made: views where float32 already, exact
    conversions of bfloat16 words."""
    return [from_bf16_bits(a) if a.dtype == np.uint16 else a for a in arrays]


def rounded(values: dict[str, np.ndarray], wire: str) -> dict[str, np.ndarray]:
    """``values`` as a reader gets them under ``wire``: as they are (``f32``), or rounded to
    bfloat16 (new float32 arrays)."""
    if wire == "f32":
        return values
    return {k: round_bf16(v) for k, v in values.items()}


def blocks(n_workers: int, per_block: int) -> list[list[int]]:
    """The workers of each block, in order: ``[[0, 1], [2, 3]]`` for 4 workers by 2."""
    return [list(range(b, min(b + per_block, n_workers))) for b in range(0, n_workers, per_block)]
