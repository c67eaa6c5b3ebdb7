"""CuPy twins of the ops in ``cpu_seq.py``: same names, signatures, semantics, shapes and
dtypes, on the raw CUDA kernels of ``seq.cu`` (GEMMs stay with the dense ops). No kernel uses
atomics: the embedding's gradient sums each token's rows in sorted order, row reductions run in
a fixed tree, and column sums go through ``gpu``'s fixed-order column sum.
"""

from __future__ import annotations

import cupy

from .common import check_float, check_rows, check_same_dtype, check_token_ids
from .gpu import col_sum
from .gpu_launch import contiguous, get_kernel, launch, launch_blocks

_CU = "seq.cu"


def _kernel(name: str, dtype) -> cupy.RawKernel:
    return get_kernel(_CU, name, dtype)


# ---------------------------------------------------------------- embedding


def embedding_forward(idx: cupy.ndarray, w: cupy.ndarray) -> cupy.ndarray:
    check_float("w", w)
    check_token_ids(idx, w.shape[0])
    idx, w = contiguous(idx, cupy.int64).reshape(-1), contiguous(w)
    y = cupy.empty((idx.size, w.shape[1]), w.dtype)
    launch(_kernel("emb_fwd", w.dtype), y.size, idx, w, y, idx.size, w.shape[1])
    return y


def embedding_backward(idx: cupy.ndarray, dy: cupy.ndarray, vocab: int) -> cupy.ndarray:
    check_float("dy", dy)
    idx, dy = contiguous(idx, cupy.int64).reshape(-1), contiguous(dy)
    check_rows("dy", dy, dy.shape[1])
    # Each token's rows, in row order (a stable argsort by counting: a graph can record it).
    counts = cupy.empty(vocab, cupy.int64)
    launch(_kernel("emb_count", dy.dtype), vocab, idx, counts, idx.size, vocab)
    starts = cupy.zeros(vocab + 1, cupy.int64)
    cupy.cumsum(counts, out=starts[1:])
    order = cupy.empty(idx.size, cupy.int64)
    launch(_kernel("emb_order", dy.dtype), vocab, idx, starts, order, idx.size, vocab)
    dw = cupy.empty((vocab, dy.shape[1]), dy.dtype)
    launch(_kernel("emb_bwd", dy.dtype), dw.size, order, starts, dy, dw, vocab, dy.shape[1])
    return dw


# ---------------------------------------------------------------- layer normalisation

# Blocks of layer norm's backward: each sums gamma's and beta's gradients over its rows into a
# row of partial sums, added up afterwards in a fixed order. A fixed number, not one per
# multiprocessor, so that the bits depend on the batch's shape only, whatever the GPU.
LN_GRID = 512


def layernorm_forward(
    x: cupy.ndarray, gamma: cupy.ndarray, beta: cupy.ndarray, eps: float
) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
    check_float("x", x)
    check_rows("x", x, gamma.shape[0])
    check_same_dtype(x=x, gamma=gamma, beta=beta)
    x, gamma, beta = contiguous(x), contiguous(gamma), contiguous(beta)
    m, f = x.shape
    y = cupy.empty_like(x)
    mean, rstd = cupy.empty(m, x.dtype), cupy.empty(m, x.dtype)
    kernel = _kernel("ln_fwd", x.dtype)
    launch_blocks(kernel, m, x, gamma, beta, y, mean, rstd, m, f, x.dtype.type(eps))
    return y, mean, rstd


def layernorm_backward(
    dy: cupy.ndarray, x: cupy.ndarray, gamma: cupy.ndarray, mean: cupy.ndarray, rstd: cupy.ndarray
) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
    check_same_dtype(dy=dy, x=x, gamma=gamma)
    dy, x = contiguous(dy), contiguous(x)
    m, f = x.shape
    blocks = min(m, LN_GRID)
    dx, part = cupy.empty_like(x), cupy.empty((blocks, 2, f), x.dtype)
    kernel = _kernel("ln_bwd", x.dtype)
    launch_blocks(kernel, blocks, dy, x, contiguous(gamma), contiguous(mean), contiguous(rstd),
                  dx, part, m, f)  # fmt: skip
    sums = part[0] if blocks == 1 else col_sum(part.reshape(blocks, 2 * f)).reshape(2, f)
    return dx, sums[0], sums[1]


def rmsnorm_forward(
    x: cupy.ndarray, gamma: cupy.ndarray, eps: float
) -> tuple[cupy.ndarray, cupy.ndarray]:
    check_float("x", x)
    check_rows("x", x, gamma.shape[0])
    check_same_dtype(x=x, gamma=gamma)
    x, gamma = contiguous(x), contiguous(gamma)
    m, f = x.shape
    y, rstd = cupy.empty_like(x), cupy.empty(m, x.dtype)
    launch_blocks(_kernel("rms_fwd", x.dtype), m, x, gamma, y, rstd, m, f, x.dtype.type(eps))
    return y, rstd


def rmsnorm_backward(
    dy: cupy.ndarray, x: cupy.ndarray, gamma: cupy.ndarray, rstd: cupy.ndarray
) -> tuple[cupy.ndarray, cupy.ndarray]:
    check_same_dtype(dy=dy, x=x, gamma=gamma)
    dy, x = contiguous(dy), contiguous(x)
    m, f = x.shape
    blocks = min(m, LN_GRID)
    dx, part = cupy.empty_like(x), cupy.empty((blocks, f), x.dtype)
    launch_blocks(_kernel("rms_bwd", x.dtype), blocks, dy, x, contiguous(gamma),
                  contiguous(rstd), dx, part, m, f)  # fmt: skip
    return dx, part[0] if blocks == 1 else col_sum(part)


# ---------------------------------------------------------------- GELU


def gelu_forward(x: cupy.ndarray) -> tuple[cupy.ndarray, cupy.ndarray]:
    check_float("x", x)
    x = contiguous(x)
    y, t = cupy.empty_like(x), cupy.empty_like(x)
    launch(_kernel("gelu_fwd", x.dtype), x.size, x, y, t, x.size)
    return y, t


def gelu_backward(dy: cupy.ndarray, x: cupy.ndarray, t: cupy.ndarray) -> cupy.ndarray:
    check_same_dtype(dy=dy, x=x, t=t)
    dy, x, t = contiguous(dy), contiguous(x), contiguous(t)
    dx = cupy.empty_like(x)
    launch(_kernel("gelu_bwd", x.dtype), x.size, dy, x, t, dx, x.size)
    return dx


# ---------------------------------------------------------------- causal attention's softmax


def causal_softmax_forward(scores: cupy.ndarray, scale: float) -> cupy.ndarray:
    check_float("scores", scores)
    t = scores.shape[-1]
    if scores.ndim != 3 or scores.shape[1] != t:
        raise ValueError(f"scores must have shape (batch, T, T), got {scores.shape}")
    scores = contiguous(scores)
    probs = cupy.empty_like(scores)
    rows = scores.shape[0] * t
    kernel = _kernel("csoftmax_fwd", scores.dtype)
    launch_blocks(kernel, rows, scores, probs, rows, t, scores.dtype.type(scale))
    return probs


def causal_softmax_backward(dp: cupy.ndarray, p: cupy.ndarray, scale: float) -> cupy.ndarray:
    check_same_dtype(dp=dp, p=p)
    dp, p = contiguous(dp), contiguous(p)
    ds = cupy.empty_like(p)
    t = p.shape[-1]
    rows = p.size // t
    launch_blocks(_kernel("csoftmax_bwd", p.dtype), rows, dp, p, ds, rows, t, p.dtype.type(scale))
    return ds


# ---------------------------------------------------------------- recurrent cells


def gru_cell_forward(
    gx: cupy.ndarray, gh: cupy.ndarray, h: cupy.ndarray
) -> tuple[cupy.ndarray, cupy.ndarray]:
    check_same_dtype(gx=gx, gh=gh, h=h)
    n, u = h.shape
    check_rows("gx", gx, 3 * u)
    check_rows("gh", gh, 3 * u)
    gx, gh, h = contiguous(gx), contiguous(gh), contiguous(h)
    h_new, gates = cupy.empty_like(h), cupy.empty((n, 4 * u), h.dtype)
    launch(_kernel("gru_fwd", h.dtype), n * u, gx, gh, h, h_new, gates, n, u)
    return h_new, gates


def gru_cell_backward(
    dh_new: cupy.ndarray, gates: cupy.ndarray, h: cupy.ndarray
) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
    check_same_dtype(dh_new=dh_new, gates=gates, h=h)
    n, u = h.shape
    check_rows("gates", gates, 4 * u)
    dh_new, gates, h = contiguous(dh_new), contiguous(gates), contiguous(h)
    dgx, dgh = cupy.empty((n, 3 * u), h.dtype), cupy.empty((n, 3 * u), h.dtype)
    dh = cupy.empty_like(h)
    launch(_kernel("gru_bwd", h.dtype), n * u, dh_new, gates, h, dgx, dgh, dh, n, u)
    return dgx, dgh, dh


def lstm_cell_forward(
    g: cupy.ndarray, c: cupy.ndarray
) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
    check_same_dtype(g=g, c=c)
    n, u = c.shape
    check_rows("g", g, 4 * u)
    g, c = contiguous(g), contiguous(c)
    h_new, c_new, acts = cupy.empty_like(c), cupy.empty_like(c), cupy.empty_like(g)
    launch(_kernel("lstm_fwd", c.dtype), n * u, g, c, h_new, c_new, acts, n, u)
    return h_new, c_new, acts


def lstm_cell_backward(
    dh_new: cupy.ndarray,
    dc_new: cupy.ndarray,
    acts: cupy.ndarray,
    c: cupy.ndarray,
    c_new: cupy.ndarray,
) -> tuple[cupy.ndarray, cupy.ndarray]:
    check_same_dtype(dh_new=dh_new, dc_new=dc_new, acts=acts, c=c, c_new=c_new)
    n, u = c.shape
    check_rows("acts", acts, 4 * u)
    args = [contiguous(a) for a in (dh_new, dc_new, acts, c, c_new)]
    dg, dc = cupy.empty((n, 4 * u), c.dtype), cupy.empty_like(c)
    launch(_kernel("lstm_bwd", c.dtype), n * u, *args, dg, dc, n, u)
    return dg, dc
