"""NumPy versions of the ops behind the sequence layers (embedding, layer norm, GELU, causal
attention's softmax, GRU and LSTM cells); ``gpu_seq.py`` has a twin of each.

Layouts: a batch of sequences is ``(N, T, F)``; these ops see it flattened to rows ``(M, F)``
where the op is per position. Gate blocks follow PyTorch's order: GRU ``(r, z, n)``, LSTM
``(i, f, g, o)``, so that weights move between the two without reordering.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .common import check_float, check_rows, check_token_ids
from .cpu_threads import over_rows

GELU_C = math.sqrt(2.0 / math.pi)  # GELU's tanh approximation: 0.5 x (1 + tanh(c (x + a x^3)))
GELU_A = 0.044715


def _row_sums(a: np.ndarray) -> np.ndarray:
    """Sums over the last axis: einsum's loop is a few times faster than ``sum(axis=-1)``
    on short rows, and as fixed in its order for a given shape."""
    return np.einsum("...i->...", a)


# ---------------------------------------------------------------- embedding


def embedding_forward(idx: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Rows of ``w`` (V, D) picked by the integer ``idx`` (M,): ``(M, D)``."""
    check_float("w", w)
    check_token_ids(idx, w.shape[0])
    return w[idx.reshape(-1)]


def embedding_backward(idx: np.ndarray, dy: np.ndarray, vocab: int) -> np.ndarray:
    """``dW`` (V, D): each row the sum of ``dy``'s rows that picked it (one GEMM with the
    one-hot matrix of the ids: BLAS sums in a fixed order for fixed shapes)."""
    check_float("dy", dy)
    idx = idx.reshape(-1)
    onehot = np.zeros((vocab, idx.size), dy.dtype)
    onehot[idx, np.arange(idx.size)] = 1
    return onehot @ dy


# ---------------------------------------------------------------- layer normalisation


def layernorm_forward(
    x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Normalise each row of ``x`` (M, F) over its F features: ``(y, mean, rstd)``, with
    ``rstd = 1 / sqrt(var + eps)`` and the biased variance (PyTorch's ``LayerNorm``)."""
    check_float("x", x)
    check_rows("x", x, gamma.shape[0])
    m, f = x.shape
    y = np.empty_like(x)
    mean, rstd = np.empty(m, x.dtype), np.empty(m, x.dtype)

    def part(lo: int, hi: int) -> None:
        xc = y[lo:hi]
        mu = _row_sums(x[lo:hi]) / x.dtype.type(f)
        np.subtract(x[lo:hi], mu[:, None], out=xc)
        var = np.einsum("ij,ij->i", xc, xc) / x.dtype.type(f)
        rs = 1 / np.sqrt(var + x.dtype.type(eps))
        xc *= rs[:, None]
        xc *= gamma
        xc += beta
        mean[lo:hi], rstd[lo:hi] = mu, rs

    over_rows(part, m, x.size)
    return y, mean, rstd


def layernorm_backward(
    dy: np.ndarray, x: np.ndarray, gamma: np.ndarray, mean: np.ndarray, rstd: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dx, dgamma, dbeta)`` of :func:`layernorm_forward`. The column sums run over all rows
    at once: their order does not depend on how many threads computed the rows."""
    return (*_norm_backward(dy, x, gamma, mean, rstd), np.einsum("ij->j", dy))


def _norm_backward(
    dy: np.ndarray, x: np.ndarray, gamma: np.ndarray, mean: np.ndarray | None, rstd: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(dx, dgamma)`` of layer norm (``mean`` given) or RMS norm (``mean`` None): with
    ``g = dy * gamma`` and ``xhat = (x - mean) * rstd`` (``x * rstd``),
    ``dx = (g - mean(g) - xhat * mean(g * xhat)) * rstd``, without ``mean(g)`` for RMS norm."""
    m, f = x.shape
    xhat, dx = np.empty_like(x), np.empty_like(x)
    inv_f = x.dtype.type(1.0 / f)

    def part(lo: int, hi: int) -> None:
        h, g = xhat[lo:hi], dx[lo:hi]
        if mean is None:
            np.multiply(x[lo:hi], rstd[lo:hi, None], out=h)
        else:
            np.subtract(x[lo:hi], mean[lo:hi, None], out=h)
            h *= rstd[lo:hi, None]
        np.multiply(dy[lo:hi], gamma, out=g)
        ghm = np.einsum("ij,ij->i", g, h) * inv_f
        if mean is not None:
            g -= (_row_sums(g) * inv_f)[:, None]
        g -= h * ghm[:, None]
        g *= rstd[lo:hi, None]

    over_rows(part, m, x.size)
    return dx, np.einsum("ij,ij->j", dy, xhat)


def rmsnorm_forward(x: np.ndarray, gamma: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Scale each row of ``x`` (M, F) by the reciprocal of its root mean square: ``(y, rstd)``
    with ``rstd = 1 / sqrt(mean(x^2) + eps)`` and ``y = x * rstd * gamma`` (PyTorch's
    ``RMSNorm(features, eps)``)."""
    check_float("x", x)
    check_rows("x", x, gamma.shape[0])
    m, f = x.shape
    y, rstd = np.empty_like(x), np.empty(m, x.dtype)

    def part(lo: int, hi: int) -> None:
        rs = 1 / np.sqrt(
            np.einsum("ij,ij->i", x[lo:hi], x[lo:hi]) / x.dtype.type(f) + x.dtype.type(eps)
        )
        np.multiply(x[lo:hi], rs[:, None], out=y[lo:hi])
        y[lo:hi] *= gamma
        rstd[lo:hi] = rs

    over_rows(part, m, x.size)
    return y, rstd


def rmsnorm_backward(
    dy: np.ndarray, x: np.ndarray, gamma: np.ndarray, rstd: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(dx, dgamma)`` of :func:`rmsnorm_forward`."""
    return _norm_backward(dy, x, gamma, None, rstd)


# ---------------------------------------------------------------- GELU


def gelu_forward(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GELU, tanh approximation (PyTorch's ``GELU(approximate="tanh")``, GPT-2's):
    ``(y, t)``, ``t = tanh(c (x + a x^3))`` kept for the backward pass."""
    check_float("x", x)
    c, a = x.dtype.type(GELU_C), x.dtype.type(GELU_A)
    flat = np.ascontiguousarray(x).reshape(-1)
    y, t = np.empty_like(flat), np.empty_like(flat)

    def part(lo: int, hi: int) -> None:
        v, tt, yy = flat[lo:hi], t[lo:hi], y[lo:hi]
        np.multiply(v, v, out=tt)
        tt *= a * c
        tt += c
        tt *= v
        np.tanh(tt, out=tt)
        np.add(tt, 1, out=yy)
        yy *= v
        yy *= 0.5

    over_rows(part, flat.size, flat.size)
    return y.reshape(x.shape), t.reshape(x.shape)


def gelu_backward(dy: np.ndarray, x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``dx`` of :func:`gelu_forward`: ``dy (0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2))``."""
    c, a = x.dtype.type(GELU_C), x.dtype.type(GELU_A)
    fx, ft = np.ascontiguousarray(x).reshape(-1), np.ascontiguousarray(t).reshape(-1)
    fdy = np.ascontiguousarray(dy).reshape(-1)
    out = np.empty_like(fx)

    def part(lo: int, hi: int) -> None:
        v, tt, s = fx[lo:hi], ft[lo:hi], out[lo:hi]
        g = v * v
        g *= 3 * a * c
        g += c
        np.multiply(tt, tt, out=s)
        np.subtract(1, s, out=s)
        s *= v
        s *= g
        s += tt
        s += 1
        s *= 0.5
        s *= fdy[lo:hi]

    over_rows(part, fx.size, fx.size)
    return out.reshape(x.shape)


# ---------------------------------------------------------------- causal attention's softmax


def causal_softmax_forward(scores: np.ndarray, scale: float) -> np.ndarray:
    """Row-wise softmax of ``scale * scores`` (B, T, T) where key ``j`` of query ``i`` is
    kept only for ``j <= i`` (the rest get probability 0)."""
    check_float("scores", scores)
    t = scores.shape[-1]
    if scores.ndim != 3 or scores.shape[1] != t:
        raise ValueError(f"scores must have shape (batch, T, T), got {scores.shape}")
    z = np.empty_like(scores)
    mask, sc = _future_mask(t, scores.dtype), scores.dtype.type(scale)

    def part(lo: int, hi: int) -> None:
        zz = z[lo:hi]
        if scale == 1.0:
            np.add(scores[lo:hi], mask, out=zz)  # -inf above the diagonal
        else:
            np.multiply(scores[lo:hi], sc, out=zz)
            zz += mask
        zz -= zz.max(axis=-1, keepdims=True)
        np.exp(zz, out=zz)
        zz /= _row_sums(zz)[..., None]

    over_rows(part, len(z), z.size)
    return z


@functools.lru_cache(maxsize=8)
def _future_mask(t: int, dtype: np.dtype) -> np.ndarray:
    mask = np.zeros((t, t), dtype)
    mask[np.triu_indices(t, 1)] = -np.inf
    mask.flags.writeable = False
    return mask


def causal_softmax_backward(dp: np.ndarray, p: np.ndarray, scale: float) -> np.ndarray:
    """The gradient with respect to the raw ``scores`` of :func:`causal_softmax_forward`."""
    ds = np.empty_like(p)
    sc = p.dtype.type(scale)

    def part(lo: int, hi: int) -> None:
        d, pp = ds[lo:hi], p[lo:hi]
        # p (dp - <dp, p>) row by row: the row's dot product without a temporary
        np.subtract(dp[lo:hi], np.einsum("bij,bij->bi", dp[lo:hi], pp)[..., None], out=d)
        d *= pp
        if scale != 1.0:
            d *= sc

    over_rows(part, len(ds), ds.size)
    return ds


# ---------------------------------------------------------------- recurrent cells


def _sigmoid(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1 / (1 + np.exp(-z))


def gru_cell_forward(
    gx: np.ndarray, gh: np.ndarray, h: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One GRU step from its pre-activations: ``gx = x W_x + b_x`` and ``gh = h W_h + b_h``,
    each (N, 3H) in the order (r, z, n). Returns ``(h_new, gates)``, ``gates`` (N, 4H) the
    values the backward step needs: r, z, n and ``gh``'s n block."""
    hs = h.shape[1]
    r = _sigmoid(gx[:, :hs] + gh[:, :hs])
    z = _sigmoid(gx[:, hs : 2 * hs] + gh[:, hs : 2 * hs])
    ghn = gh[:, 2 * hs :]
    n = np.tanh(gx[:, 2 * hs :] + r * ghn)
    h_new = (1 - z) * n + z * h
    return h_new, np.concatenate([r, z, n, ghn], axis=1)


def gru_cell_backward(
    dh_new: np.ndarray, gates: np.ndarray, h: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dgx, dgh, dh)`` of one :func:`gru_cell_forward` step (``dh`` is the part that goes
    straight to ``h``; the part through ``gh`` is ``dgh @ W_h.T``)."""
    hs = h.shape[1]
    r, z, n, ghn = (gates[:, k * hs : (k + 1) * hs] for k in range(4))
    dn = dh_new * (1 - z)
    dz = dh_new * (h - n)
    dan = dn * (1 - n * n)  # through tanh
    dr = dan * ghn
    dar = dr * r * (1 - r)
    daz = dz * z * (1 - z)
    dgx = np.concatenate([dar, daz, dan], axis=1)
    dgh = np.concatenate([dar, daz, dan * r], axis=1)
    return dgx, dgh, dh_new * z


def lstm_cell_forward(g: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One LSTM step from its summed pre-activations ``g`` (N, 4H), order (i, f, g, o), and
    the cell ``c``: ``(h_new, c_new, acts)``, ``acts`` the gates after their activations."""
    hs = c.shape[1]
    i = _sigmoid(g[:, :hs])
    f = _sigmoid(g[:, hs : 2 * hs])
    gg = np.tanh(g[:, 2 * hs : 3 * hs])
    o = _sigmoid(g[:, 3 * hs :])
    c_new = f * c + i * gg
    h_new = o * np.tanh(c_new)
    return h_new, c_new, np.concatenate([i, f, gg, o], axis=1)


def lstm_cell_backward(
    dh_new: np.ndarray, dc_new: np.ndarray, acts: np.ndarray, c: np.ndarray, c_new: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(dg, dc)`` of one :func:`lstm_cell_forward` step: the pre-activations' gradient and
    the gradient that flows to the previous cell."""
    hs = c.shape[1]
    i, f, gg, o = (acts[:, k * hs : (k + 1) * hs] for k in range(4))
    tc = np.tanh(c_new)
    dc = dc_new + dh_new * o * (1 - tc * tc)
    dg = np.concatenate(
        [
            dc * gg * i * (1 - i),
            dc * c * f * (1 - f),
            dc * i * (1 - gg * gg),
            dh_new * tc * o * (1 - o),
        ],
        axis=1,
    )
    return dg, dc * f
