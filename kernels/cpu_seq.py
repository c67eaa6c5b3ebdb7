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

GELU_C = math.sqrt(2.0 / math.pi)  # GELU's tanh approximation: 0.5 x (1 + tanh(c (x + a x^3)))
GELU_A = 0.044715


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
    mean = x.mean(axis=1)
    xc = x - mean[:, None]
    var = (xc * xc).mean(axis=1)
    rstd = (1.0 / np.sqrt(var + eps)).astype(x.dtype, copy=False)
    y = xc * rstd[:, None] * gamma + beta
    return y, mean, rstd


def layernorm_backward(
    dy: np.ndarray, x: np.ndarray, gamma: np.ndarray, mean: np.ndarray, rstd: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dx, dgamma, dbeta)`` of :func:`layernorm_forward`."""
    xhat = (x - mean[:, None]) * rstd[:, None]
    dgamma = (dy * xhat).sum(axis=0)
    dbeta = dy.sum(axis=0)
    g = dy * gamma
    f = x.shape[1]
    dx = (g - g.mean(axis=1)[:, None] - xhat * (g * xhat).sum(axis=1)[:, None] / f) * rstd[:, None]
    return dx, dgamma, dbeta


# ---------------------------------------------------------------- GELU


def gelu_forward(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GELU, tanh approximation (PyTorch's ``GELU(approximate="tanh")``, GPT-2's):
    ``(y, t)``, ``t = tanh(c (x + a x^3))`` kept for the backward pass."""
    check_float("x", x)
    c, a = x.dtype.type(GELU_C), x.dtype.type(GELU_A)
    t = x * x
    t *= a * c
    t += c
    t *= x
    np.tanh(t, out=t)
    y = t + 1
    y *= x
    y *= 0.5
    return y, t


def gelu_backward(dy: np.ndarray, x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``dx`` of :func:`gelu_forward`: ``dy (0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2))``."""
    c, a = x.dtype.type(GELU_C), x.dtype.type(GELU_A)
    g = x * x
    g *= 3 * a * c
    g += c
    s = t * t
    np.subtract(1, s, out=s)
    s *= x
    s *= g
    s += t
    s += 1
    s *= 0.5
    s *= dy
    return s


# ---------------------------------------------------------------- causal attention's softmax


def causal_softmax_forward(scores: np.ndarray, scale: float) -> np.ndarray:
    """Row-wise softmax of ``scale * scores`` (B, T, T) where key ``j`` of query ``i`` is
    kept only for ``j <= i`` (the rest get probability 0)."""
    check_float("scores", scores)
    t = scores.shape[-1]
    if scores.ndim != 3 or scores.shape[1] != t:
        raise ValueError(f"scores must have shape (batch, T, T), got {scores.shape}")
    z = scores * scores.dtype.type(scale)
    z += _future_mask(t, scores.dtype)  # -inf above the diagonal
    z -= z.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    return z


@functools.lru_cache(maxsize=8)
def _future_mask(t: int, dtype: np.dtype) -> np.ndarray:
    mask = np.zeros((t, t), dtype)
    mask[np.triu_indices(t, 1)] = -np.inf
    mask.flags.writeable = False
    return mask


def causal_softmax_backward(dp: np.ndarray, p: np.ndarray, scale: float) -> np.ndarray:
    """The gradient with respect to the raw ``scores`` of :func:`causal_softmax_forward`."""
    ds = dp * p
    s = ds.sum(axis=-1, keepdims=True)
    ds -= p * s
    ds *= p.dtype.type(scale)
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
