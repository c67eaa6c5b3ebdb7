"""Causal multi-head self-attention in one fused pass on the GPU (``attention.cu``).

The forward pass keeps each row's log-sum-exp ``(n * heads, T)`` in place of the ``(T, T)``
probabilities, and the backward pass recomputes them tile by tile. Queries, keys and values are
read where the projection left them, ``(n, T, 3, heads, head_dim)``, and their gradients are
written back in that layout, so neither pass copies a head out. No atomics: every run gives the
same bits. Imports CuPy: imported only once a CuPy array shows up.
"""

from __future__ import annotations

import cupy

from .common import check_float, check_same_dtype
from .gpu_launch import contiguous, get_kernel, launch, launch_blocks

_CU = "attention.cu"
HEAD_DIM_MAX = 64  # attention.cu's HD_MAX: a tile row of shared memory holds this many
# Rows per tile, as attention.cu's Tile<T>::R: a block per (sequence, head, tile of rows).
_TILE_ROWS = {"float32": 32, "float64": 16}


def supports(head_dim: int, dtype) -> bool:
    """Whether the fused kernels take heads of ``head_dim`` in ``dtype``."""
    return 0 < head_dim <= HEAD_DIM_MAX and str(dtype) in _TILE_ROWS


def _geometry(qkv: cupy.ndarray, heads: int) -> tuple[int, int, int, int]:
    check_float("qkv", qkv)
    if qkv.ndim != 3 or qkv.shape[2] % (3 * heads):
        raise ValueError(f"qkv must have shape (n, T, 3 * heads * head_dim), got {qkv.shape}")
    n, t, d3 = qkv.shape
    hd = d3 // (3 * heads)
    if not supports(hd, qkv.dtype):
        raise ValueError(f"fused attention takes head_dim <= {HEAD_DIM_MAX}, got {hd}")
    return n, t, heads, hd


def _blocks(n: int, h: int, t: int, dtype) -> int:
    return n * h * -(-t // _TILE_ROWS[str(dtype)])


def attention_forward(
    qkv: cupy.ndarray, heads: int, scale: float
) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``(out, lse)``: ``out`` (n, T, heads * head_dim) the heads side by side, each
    ``softmax(scale q k^T, causal) v``; ``lse`` (n * heads, T) each row's log-sum-exp."""
    n, t, h, hd = _geometry(qkv, heads)
    qkv, d = contiguous(qkv), h * hd
    out = cupy.empty((n, t, d), qkv.dtype)
    lse = cupy.empty((n * h, t), qkv.dtype)
    kernel = get_kernel(_CU, "attn_fwd", qkv.dtype)
    launch_blocks(kernel, _blocks(n, h, t, qkv.dtype), qkv, qkv[:, :, d:], qkv[:, :, 2 * d:],
                  3 * d, out, d, lse, n, h, t, hd, qkv.dtype.type(scale))  # fmt: skip
    return out, lse


def attention_backward(
    dout: cupy.ndarray,
    qkv: cupy.ndarray,
    out: cupy.ndarray,
    lse: cupy.ndarray,
    heads: int,
    scale: float,
) -> cupy.ndarray:
    """The gradient ``(n, T, 3 * heads * head_dim)`` of :func:`attention_forward` with respect
    to ``qkv``, laid out as ``qkv``."""
    n, t, h, hd = _geometry(qkv, heads)
    check_same_dtype(dout=dout, qkv=qkv, out=out, lse=lse)
    d = h * hd
    if dout.shape != (n, t, d) or out.shape != (n, t, d) or lse.shape != (n * h, t):
        raise ValueError(f"dout, out {dout.shape}, {out.shape} and lse {lse.shape} do not fit")
    qkv, dout, out, lse = (contiguous(a) for a in (qkv, dout, out, lse))
    q, k, v, dt = qkv, qkv[:, :, d:], qkv[:, :, 2 * d:], qkv.dtype  # fmt: skip
    delta = cupy.empty((n * h, t), dt)
    launch(get_kernel(_CU, "attn_bwd_delta", dt), n * h * t, dout, out, d, delta, n, h, t, hd)
    dqkv = cupy.empty_like(qkv)
    blocks, sc = _blocks(n, h, t, dt), dt.type(scale)
    launch_blocks(get_kernel(_CU, "attn_bwd_dq", dt), blocks, q, k, v, 3 * d, dout, d, lse,
                  delta, dqkv, 3 * d, n, h, t, hd, sc)  # fmt: skip
    launch_blocks(get_kernel(_CU, "attn_bwd_dkv", dt), blocks, q, k, v, 3 * d, dout, d, lse,
                  delta, dqkv[:, :, d:], dqkv[:, :, 2 * d:], 3 * d, n, h, t, hd, sc)  # fmt: skip
    return dqkv
