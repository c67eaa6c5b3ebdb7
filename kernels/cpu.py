"""NumPy versions of the ops behind the layers; the reference the CUDA kernels are tested against.

Every function here has a twin of the same name and signature in ``gpu.py``. Layouts: dense inputs
are ``(N, F)``; images are NCHW; convolution weights are ``(O, C, KH, KW)``. Inputs must be float32
or float64; integer labels are int32/int64.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from . import common
from .common import check_float, conv_out_size, draws24, dropout_threshold
from .precision import operand

# ---------------------------------------------------------------- activations and dense layers


def activation_forward(z: np.ndarray, act: str) -> np.ndarray:
    common.check_activation(act)
    if act == "linear":
        return z.copy()
    if act == "relu":
        return np.maximum(z, 0)
    if act == "sigmoid":
        with np.errstate(over="ignore"):
            return (1 / (1 + np.exp(-z))).astype(z.dtype, copy=False)
    return np.tanh(z)


def activation_backward(dy: np.ndarray, y: np.ndarray, act: str) -> np.ndarray:
    """Gradient through an activation, written in terms of its output ``y``."""
    common.check_activation(act)
    if act == "linear":
        return dy.copy()
    if act == "relu":
        return dy * (y > 0)
    if act == "sigmoid":
        return dy * y * (1 - y)
    return dy * (1 - y * y)


def bias_act_forward(z: np.ndarray, b: np.ndarray, act: str) -> np.ndarray:
    """``act(z + b)`` for ``z`` of shape ``(M, F)`` and ``b`` of shape ``(F,)``."""
    common.check_bias(z, b)
    common.check_activation(act)
    return _bias_act_inplace(z + b, None, act)


def _bias_act_inplace(out: np.ndarray, b: np.ndarray | None, act: str) -> np.ndarray:
    """``act(out + b)`` written over ``out``, a fresh array of the caller's (a GEMM's result):
    NumPy cannot fuse, but it need not allocate again."""
    if b is not None:
        out += b
    if act == "relu":
        np.maximum(out, 0, out=out)
    elif act == "tanh":
        np.tanh(out, out=out)
    elif act == "sigmoid":
        with np.errstate(over="ignore"):
            np.negative(out, out=out)
            np.exp(out, out=out)
            out += 1
            np.reciprocal(out, out=out)
    return out


def bias_act_backward(dy: np.ndarray, y: np.ndarray, act: str) -> tuple[np.ndarray, np.ndarray]:
    """Gradients w.r.t. the pre-activation and the bias: ``(dz, db)``."""
    dz = activation_backward(dy, y, act)
    return dz, dz.sum(axis=0)


def _bias_act_grads(dy: np.ndarray, y: np.ndarray, act: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`bias_act_backward` for callers that only read ``dz``: a linear layer's ``dz`` is
    ``dy`` itself, not a copy."""
    if act == "linear":
        return dy, dy.sum(axis=0)
    return bias_act_backward(dy, y, act)


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a @ b`` (NumPy's matmul rules), written into ``out`` (any strides) where given; the
    operands in this process's compute precision (:mod:`.precision`)."""
    return np.matmul(operand(a), operand(b), out=out)


def dense_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray, act: str) -> np.ndarray:
    common.check_dense(x, w, b)
    common.check_activation(act)
    return _bias_act_inplace(matmul(x, w), b, act)


def dense_backward(
    x: np.ndarray,
    w: np.ndarray,
    y: np.ndarray,
    dy: np.ndarray,
    act: str,
    need_dx: bool = True,
    dw_out: np.ndarray | None = None,
    grads_ready: Callable[[np.ndarray, np.ndarray], None] | None = None,
    row_blocks: int = 1,
    first_block: int = 0,
    rows_ready: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dx, dw, db)`` for ``y = act(x @ w + b)``; ``dx`` is None unless ``need_dx`` (a net's
    first layer skips a whole GEMM that way). ``dw`` is written into ``dw_out`` where given
    (the same product, so the same bits). ``grads_ready(dw, db)`` is called once they are
    final, before ``dx`` is computed (which still reads ``w``).

    ``row_blocks``: ``dw`` computed as that many blocks of its rows, each a GEMM of its own
    (:func:`.common.row_bounds`; the bits depend on the blocks, not on their order), from block
    ``first_block`` on, round; ``rows_ready(a, b)`` is told as rows ``[a, b)`` of ``dw`` are
    final (what a worker sends on while it computes the rest)."""
    dz, db = _bias_act_grads(dy, y, act)
    if row_blocks <= 1:
        dw = matmul(x.T, dz, dw_out)
    else:
        dw = _dw_by_rows(x, dz, dw_out, row_blocks, first_block, rows_ready)
    if grads_ready is not None:
        grads_ready(dw, db)
    return (matmul(dz, w.T) if need_dx else None), dw, db


def _dw_by_rows(
    x: np.ndarray,
    dz: np.ndarray,
    out: np.ndarray | None,
    blocks: int,
    first: int,
    rows_ready: Callable[[int, int], None] | None,
) -> np.ndarray:
    """``x.T @ dz`` by blocks of rows (:func:`dense_backward`)."""
    bounds = common.row_bounds(x.shape[1], blocks)
    k = len(bounds) - 1
    for j in range(k):
        i = (first + j) % k
        a, b = bounds[i], bounds[i + 1]
        block = matmul(x[:, a:b].T, dz, None if out is None else out[a:b])
        if out is None:
            out = np.empty((x.shape[1], block.shape[1]), block.dtype)
            out[a:b] = block
        if rows_ready is not None:
            rows_ready(a, b)
    assert out is not None
    return out


# ---------------------------------------------------------------- losses


def softmax_xent_forward(
    logits: np.ndarray, labels: np.ndarray, denom: float
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax cross-entropy: ``(loss, probs)``, loss summed over rows and divided by ``denom``."""
    common.check_labels(logits, labels)
    m = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - m)
    s = e.sum(axis=1, keepdims=True)
    probs = e / s
    picked = np.take_along_axis(logits, labels.reshape(-1, 1).astype(np.int64), axis=1)
    per_row = (np.log(s) - (picked - m)).ravel()
    return np.asarray(per_row.sum() / denom, dtype=logits.dtype), probs


def softmax_xent_backward(probs: np.ndarray, labels: np.ndarray, denom: float) -> np.ndarray:
    d = probs.copy()
    d[np.arange(len(labels)), labels] -= 1
    d /= np.asarray(denom, dtype=probs.dtype)
    return d


def softmax_xent(
    logits: np.ndarray, labels: np.ndarray, denom: float
) -> tuple[np.ndarray, np.ndarray]:
    """``(loss, dlogits)``: :func:`softmax_xent_forward` then :func:`softmax_xent_backward`,
    the probabilities turned into the gradient in place."""
    loss, d = softmax_xent_forward(logits, labels, denom)
    d[np.arange(len(labels)), labels] -= 1
    d /= np.asarray(denom, dtype=d.dtype)
    return loss, d


# ---------------------------------------------------------------- convolution (im2col + GEMM)


def im2col(x: np.ndarray, kh: int, kw: int, stride: int, pad: int) -> np.ndarray:
    """Patches of an NCHW batch as rows: ``(N*OH*OW, C*KH*KW)``, channel-major within a row."""
    n, c, h, w = x.shape
    oh, ow = conv_out_size(h, kh, stride, pad), conv_out_size(w, kw, stride, pad)
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad))) if pad else x
    win = sliding_window_view(xp, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride][:, :, :oh, :ow]
    return win.transpose(0, 2, 3, 1, 4, 5).reshape(n * oh * ow, c * kh * kw)


def col2im(cols: np.ndarray, x_shape: tuple, kh: int, kw: int, stride: int, pad: int) -> np.ndarray:
    """The adjoint of :func:`im2col`: overlapping patches are summed back into an NCHW batch."""
    n, c, h, w = x_shape
    oh, ow = conv_out_size(h, kh, stride, pad), conv_out_size(w, kw, stride, pad)
    c6 = cols.reshape(n, oh, ow, c, kh, kw).transpose(0, 3, 4, 5, 1, 2)  # n c kh kw oh ow
    dxp = np.zeros((n, c, h + 2 * pad, w + 2 * pad), dtype=cols.dtype)
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i : i + stride * oh : stride, j : j + stride * ow : stride] += c6[:, :, i, j]
    return dxp[:, :, pad : pad + h, pad : pad + w]


def conv2d_forward(
    x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int, pad: int, act: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(y, cols)``: ``y`` is NCHW; ``cols`` is kept for the backward pass."""
    common.check_conv(x, w, b, stride, pad)
    n, _, h, wd = x.shape
    o, _, kh, kw = w.shape
    oh, ow = conv_out_size(h, kh, stride, pad), conv_out_size(wd, kw, stride, pad)
    cols = im2col(x, kh, kw, stride, pad)
    common.check_activation(act)
    z = _bias_act_inplace(matmul(cols, w.reshape(o, -1).T), b, act)  # (n*oh*ow, o)
    return np.ascontiguousarray(z.reshape(n, oh, ow, o).transpose(0, 3, 1, 2)), cols


def conv2d_backward(
    dy: np.ndarray,
    y: np.ndarray,
    cols: np.ndarray,
    w: np.ndarray,
    x_shape: tuple,
    stride: int,
    pad: int,
    act: str,
    need_dx: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dx, dw, db)`` of :func:`conv2d_forward`."""
    o, c, kh, kw = w.shape
    y2 = y.transpose(0, 2, 3, 1).reshape(-1, o)
    dy2 = dy.transpose(0, 2, 3, 1).reshape(-1, o)
    dz, db = _bias_act_grads(dy2, y2, act)
    dw = matmul(dz.T, cols).reshape(w.shape)
    if not need_dx:
        return None, dw, db
    dx = col2im(matmul(dz, w.reshape(o, -1)), x_shape, kh, kw, stride, pad)
    return np.ascontiguousarray(dx), dw, db


# ---------------------------------------------------------------- pooling


def _windows(x: np.ndarray, k: int, stride: int, pad: int, fill: float) -> np.ndarray:
    n, c, h, w = x.shape
    oh, ow = conv_out_size(h, k, stride, pad), conv_out_size(w, k, stride, pad)
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=fill) if pad else x
    win = sliding_window_view(xp, (k, k), axis=(2, 3))[:, :, ::stride, ::stride][:, :, :oh, :ow]
    return win.reshape(n, c, oh, ow, k * k)


def _scatter_windows(
    parts: np.ndarray, x_shape: tuple, k: int, stride: int, pad: int
) -> np.ndarray:
    """Sum ``parts`` of shape ``(N, C, OH, OW, K*K)`` back onto the input grid."""
    n, c, h, w = x_shape
    oh, ow = parts.shape[2], parts.shape[3]
    dxp = np.zeros((n, c, h + 2 * pad, w + 2 * pad), dtype=parts.dtype)
    for i in range(k):
        for j in range(k):
            dxp[:, :, i : i + stride * oh : stride, j : j + stride * ow : stride] += parts[
                ..., i * k + j
            ]
    return np.ascontiguousarray(dxp[:, :, pad : pad + h, pad : pad + w])


def maxpool_forward(x: np.ndarray, k: int, stride: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """``(y, argmax)``; ``argmax`` is the int32 position in the window (first maximum wins)."""
    common.check_pool(x, k, stride, pad)
    win = _windows(x, k, stride, pad, -np.inf)
    arg = win.argmax(axis=-1)
    y = np.take_along_axis(win, arg[..., None], axis=-1)[..., 0]
    return np.ascontiguousarray(y), arg.astype(np.int32)


def maxpool_backward(
    dy: np.ndarray, argmax: np.ndarray, x_shape: tuple, k: int, stride: int, pad: int
) -> np.ndarray:
    parts = (argmax[..., None] == np.arange(k * k, dtype=np.int32)) * dy[..., None]
    return _scatter_windows(parts.astype(dy.dtype, copy=False), x_shape, k, stride, pad)


def avgpool_forward(x: np.ndarray, k: int, stride: int, pad: int) -> np.ndarray:
    """Average pooling; padded zeros count in the divisor (``count_include_pad``)."""
    common.check_pool(x, k, stride, pad)
    win = _windows(x, k, stride, pad, 0.0)
    return np.ascontiguousarray(win.sum(axis=-1) / np.asarray(k * k, dtype=x.dtype))


def avgpool_backward(dy: np.ndarray, x_shape: tuple, k: int, stride: int, pad: int) -> np.ndarray:
    share = (dy / np.asarray(k * k, dtype=dy.dtype))[..., None]
    parts = np.broadcast_to(share, dy.shape + (k * k,))
    return _scatter_windows(parts, x_shape, k, stride, pad)


# ---------------------------------------------------------------- dropout (counter-based)


def dropout_mask(
    x: np.ndarray, rate: float, key: int, sample_offset: int, key_offset: None = None
) -> np.ndarray:
    """The scaled keep-mask for ``x``, whose first row is global sample ``sample_offset``.

    Element ``j`` of global sample ``s`` is kept iff the top 24 bits of
    ``mix64(key + (s * per_sample + j) * GOLDEN)`` are at least ``round(rate * 2**24)``; kept
    elements are scaled by ``1 / (1 - rate)``. ``key`` comes from :func:`common.dropout_key`.
    ``key_offset`` is the GPU's (a device copy of the key and offset for a CUDA graph).
    """
    if key_offset is not None:
        raise ValueError("dropout_mask: key_offset (a device copy of the key) is for the GPU")
    check_float("x", x)
    thresh = dropout_threshold(rate)
    n = x.shape[0]
    per = x.size // n if n else 0
    keep = draws24(np, key, sample_offset, n, per) >= np.uint64(thresh)
    scale = np.asarray(1.0 / (1.0 - rate), dtype=x.dtype)
    return (keep.reshape(x.shape) * scale).astype(x.dtype, copy=False)


# ---------------------------------------------------------------- batch normalisation


def _bn_axes(x: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Reduction axes and the broadcast shape of per-channel vectors (channel axis is 1)."""
    axes = (0,) + tuple(range(2, x.ndim))
    return axes, (1, x.shape[1]) + (1,) * (x.ndim - 2)


def batchnorm_forward_train(
    x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(y, mean, var, inv_std)`` using the batch's statistics (``var`` is the biased one)."""
    common.check_bn(x, gamma, beta)
    axes, bshape = _bn_axes(x)
    mean = x.mean(axis=axes)
    var = ((x - mean.reshape(bshape)) ** 2).mean(axis=axes)
    inv_std = 1 / np.sqrt(var + np.asarray(eps, dtype=x.dtype))
    xhat = (x - mean.reshape(bshape)) * inv_std.reshape(bshape)
    return xhat * gamma.reshape(bshape) + beta.reshape(bshape), mean, var, inv_std


def batchnorm_forward_infer(
    x: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    mean: np.ndarray,
    var: np.ndarray,
    eps: float,
) -> np.ndarray:
    common.check_bn(x, gamma, beta)
    _, bshape = _bn_axes(x)
    inv_std = 1 / np.sqrt(var + np.asarray(eps, dtype=x.dtype))
    scale = (gamma * inv_std).reshape(bshape)
    return (x - mean.reshape(bshape)) * scale + beta.reshape(bshape)


def batchnorm_backward(
    dy: np.ndarray, x: np.ndarray, gamma: np.ndarray, mean: np.ndarray, inv_std: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dx, dgamma, dbeta)`` of :func:`batchnorm_forward_train`."""
    axes, bshape = _bn_axes(x)
    m = x.size // x.shape[1]
    xhat = (x - mean.reshape(bshape)) * inv_std.reshape(bshape)
    dbeta = dy.sum(axis=axes)
    dgamma = (dy * xhat).sum(axis=axes)
    k = (gamma * inv_std / m).reshape(bshape)
    dx = k * (m * dy - dbeta.reshape(bshape) - xhat * dgamma.reshape(bshape))
    return dx.astype(x.dtype, copy=False), dgamma, dbeta
