"""CuPy twins of the ops in ``cpu.py``: same names, signatures, semantics, shapes and dtypes.

This module mirrors ``cpu.py`` op for op, returning CuPy arrays. GEMMs go to cuBLAS through CuPy;
everything else runs in the raw CUDA kernels of the ``*.cu`` files shipped with this package,
loaded and launched through ``gpu_launch``. Raw kernels check nothing, so each op validates with
``common`` and makes its inputs C-contiguous before launch. No kernel uses atomics: every reduction
runs in a fixed order, so two runs give the same bits.

The optimizer updates and the stub's gradient sum live in ``gpu_optim`` (they are not twins of
``cpu.py`` ops); callers import them from there.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import cupy
import numpy as np

from . import common, gpu_blas, precision
from .common import check_float, check_same_dtype, conv_out_size, dropout_threshold
from .gpu_launch import (
    contiguous,
    get_kernel,
    launch,
    launch_blocks,
)

SUM_CHUNK = 256  # rows one thread adds in order per pass of the column sum


def _check_like(ref_name: str, ref, **arrays) -> None:
    """Arrays that a kernel indexes like ``ref``: same shape and dtype (cpu.py would broadcast)."""
    check_float(ref_name, ref)
    check_same_dtype(**{ref_name: ref}, **arrays)
    for name, a in arrays.items():
        if a.shape != ref.shape:
            raise ValueError(f"{name} of shape {a.shape} does not match {ref_name} {ref.shape}")


def _check_vectors(n: int, **vectors) -> None:
    for name, v in vectors.items():
        if v.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {v.shape}")


# ---------------------------------------------------------------- activations and dense layers


def _act_code(act: str) -> int:
    common.check_activation(act)
    return common.ACTIVATIONS.index(act)  # the codes activation.cu switches on


def activation_forward(z: cupy.ndarray, act: str) -> cupy.ndarray:
    code = _act_code(act)
    check_float("z", z)
    z = contiguous(z)
    y = cupy.empty_like(z)
    launch(get_kernel("activation.cu", "act_fwd", z.dtype), z.size, z, y, z.size, code)
    return y


def activation_backward(dy: cupy.ndarray, y: cupy.ndarray, act: str) -> cupy.ndarray:
    """Gradient through an activation, written in terms of its output ``y``."""
    code = _act_code(act)
    _check_like("dy", dy, y=y)
    dy, y = contiguous(dy), contiguous(y)
    dz = cupy.empty_like(dy)
    launch(get_kernel("activation.cu", "act_bwd", dy.dtype), dy.size, dy, y, dz, dy.size, code)
    return dz


def bias_act_forward(z: cupy.ndarray, b: cupy.ndarray, act: str) -> cupy.ndarray:
    """``act(z + b)`` for ``z`` of shape ``(M, F)`` and ``b`` of shape ``(F,)``, in one kernel."""
    common.check_bias(z, b)
    code = _act_code(act)
    z, b = contiguous(z), contiguous(b)
    y = cupy.empty_like(z)
    kernel = get_kernel("activation.cu", "bias_act_fwd", z.dtype)
    launch(kernel, z.size, z, b, y, z.size, z.shape[1], code)
    return y


def col_sum(a: cupy.ndarray) -> cupy.ndarray:
    """``a.sum(axis=0)`` in a fixed order: rows chunk by chunk, then the chunk sums, in turn."""
    m, f = a.shape[0], math.prod(a.shape[1:])
    if m == 0:
        return cupy.zeros(a.shape[1:], a.dtype)
    part = contiguous(a).reshape(m, f)
    kernel = get_kernel("activation.cu", "col_sum", a.dtype)
    while True:
        chunks = -(-m // SUM_CHUNK)
        out = cupy.empty((chunks, f), a.dtype)
        launch(kernel, chunks * f, part, out, m, f, SUM_CHUNK)
        part, m = out, chunks
        if m == 1:
            return part.reshape(a.shape[1:])


def bias_act_backward(
    dy: cupy.ndarray, y: cupy.ndarray, act: str
) -> tuple[cupy.ndarray, cupy.ndarray]:
    """Gradients w.r.t. the pre-activation and the bias: ``(dz, db)``. The first pass of the
    bias's column sum runs in the activation's backward kernel (``act_bwd_col_sum``): the same
    bits as :func:`activation_backward` then :func:`col_sum`, one launch fewer."""
    code = _act_code(act)
    _check_like("dy", dy, y=y)
    dy, y = contiguous(dy), contiguous(y)
    m, f = dy.shape[0], math.prod(dy.shape[1:])
    dz = cupy.empty_like(dy)
    if m == 0:
        return dz, cupy.zeros(dy.shape[1:], dy.dtype)
    part = cupy.empty((-(-m // SUM_CHUNK), f), dy.dtype)
    kernel = get_kernel("activation.cu", "act_bwd_col_sum", dy.dtype)
    launch(kernel, part.size, dy, y, dz, part, m, f, SUM_CHUNK, code)
    db = part if part.shape[0] == 1 else col_sum(part)
    return dz, db.reshape(dy.shape[1:])


def matmul(a: cupy.ndarray, b: cupy.ndarray, out: cupy.ndarray | None = None) -> cupy.ndarray:
    """``a @ b`` (NumPy's matmul rules), written into ``out`` (any strides) where given: through
    raysinga's own cuBLAS handle where CUDA graphs are on (``gpu_blas``: a graph can capture
    it) or the compute precision is TF32 or bf16 (:mod:`.precision`), else through CuPy's."""
    if gpu_blas.active() or precision.compute() != "f32":
        return gpu_blas.matmul(a, b, out)
    if out is None:
        return cupy.matmul(a, b)
    if out.flags.c_contiguous:
        return cupy.matmul(a, b, out=out)
    out[...] = cupy.matmul(a, b)
    return out


def dense_forward(x: cupy.ndarray, w: cupy.ndarray, b: cupy.ndarray, act: str) -> cupy.ndarray:
    common.check_dense(x, w, b)
    return bias_act_forward(matmul(x, w), b, act)


def dense_backward(
    x: cupy.ndarray,
    w: cupy.ndarray,
    y: cupy.ndarray,
    dy: cupy.ndarray,
    act: str,
    need_dx: bool = True,
    dw_out: cupy.ndarray | None = None,
    grads_ready: Callable[[cupy.ndarray, cupy.ndarray], None] | None = None,
    row_blocks: int = 1,
    first_block: int = 0,
    rows_ready: Callable[[int, int], None] | None = None,
) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
    """``(dx, dw, db)`` for ``y = act(x @ w + b)``; ``dx`` is None unless ``need_dx`` (a net's
    first layer skips a whole GEMM that way). ``dw`` is written into ``dw_out`` where given.
    ``grads_ready(dw, db)`` is called once they are launched, before ``dx`` is. ``dw`` is one
    GEMM whatever ``row_blocks`` (the CPU twin's blocks let a worker send rows of it as they
    are done; a GPU worker's gradients leave the device whole), and ``rows_ready`` is not
    called."""
    dz, db = bias_act_backward(dy, y, act)
    dw = matmul(x.T, dz, dw_out)
    if grads_ready is not None:
        grads_ready(dw, db)
    return (matmul(dz, w.T) if need_dx else None), dw, db


# ---------------------------------------------------------------- losses


def softmax_xent_forward(
    logits: cupy.ndarray, labels: cupy.ndarray, denom: float
) -> tuple[cupy.ndarray, cupy.ndarray]:
    """Softmax cross-entropy: ``(loss, probs)``, loss summed over rows and divided by ``denom``."""
    common.check_labels(logits, labels)
    logits, labels = contiguous(logits), contiguous(labels, cupy.int64)
    n, c = logits.shape
    probs = cupy.empty_like(logits)
    per_row = cupy.empty((n, 1), logits.dtype)
    kernel = get_kernel("softmax_xent.cu", "xent_fwd", logits.dtype)
    launch_blocks(kernel, n, logits, labels, probs, per_row, n, c)
    # denom as a scalar of the logits' dtype (a kernel argument, not an upload a graph cannot
    # capture): the division rounds as it did against a 0-d array of that dtype.
    loss = col_sum(per_row)[0] / logits.dtype.type(denom)
    return loss.astype(logits.dtype, copy=False), probs


def softmax_xent(
    logits: cupy.ndarray, labels: cupy.ndarray, denom: float
) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``(loss, dlogits)`` in one kernel: the bits of :func:`softmax_xent_forward` then
    :func:`softmax_xent_backward`, without writing the probabilities."""
    common.check_labels(logits, labels)
    logits, labels = contiguous(logits), contiguous(labels, cupy.int64)
    n, c = logits.shape
    d, per_row = cupy.empty_like(logits), cupy.empty((n, 1), logits.dtype)
    denom_t = logits.dtype.type(denom)
    kernel = get_kernel("softmax_xent.cu", "xent_grad", logits.dtype)
    launch_blocks(kernel, n, logits, labels, d, per_row, n, c, denom_t)
    loss = col_sum(per_row)[0] / denom_t
    return loss.astype(logits.dtype, copy=False), d


def softmax_xent_backward(probs: cupy.ndarray, labels: cupy.ndarray, denom: float) -> cupy.ndarray:
    common.check_labels(probs, labels)
    probs, labels = contiguous(probs), contiguous(labels, cupy.int64)
    d = cupy.empty_like(probs)
    kernel = get_kernel("softmax_xent.cu", "xent_bwd", probs.dtype)
    launch(kernel, d.size, probs, labels, d, *probs.shape, probs.dtype.type(denom))
    return d


# ---------------------------------------------------------------- convolution (im2col + GEMM)


def _window_geometry(x_shape: tuple, kh: int, kw: int, stride: int, pad: int) -> tuple:
    """``(n, c, h, w, oh, ow)``; rejects what would make a kernel index out of bounds."""
    if len(x_shape) != 4:
        raise ValueError(f"expected an NCHW shape, got {tuple(x_shape)}")
    if kh < 1 or kw < 1 or stride < 1 or pad < 0:
        raise ValueError(
            f"window {kh}x{kw} needs sizes and stride >= 1 and padding >= 0, "
            f"got stride {stride}, padding {pad}"
        )
    n, c, h, w = (int(s) for s in x_shape)
    return n, c, h, w, conv_out_size(h, kh, stride, pad), conv_out_size(w, kw, stride, pad)


def im2col(x: cupy.ndarray, kh: int, kw: int, stride: int, pad: int) -> cupy.ndarray:
    """Patches of an NCHW batch as rows: ``(N*OH*OW, C*KH*KW)``, channel-major within a row."""
    check_float("x", x)
    n, c, h, w, oh, ow = _window_geometry(x.shape, kh, kw, stride, pad)
    x = contiguous(x)
    cols = cupy.empty((n * oh * ow, c * kh * kw), x.dtype)
    kernel = get_kernel("im2col.cu", "im2col", x.dtype)
    launch(kernel, cols.size, x, cols, n, c, h, w, kh, kw, stride, pad, oh, ow)
    return cols


def col2im(
    cols: cupy.ndarray, x_shape: tuple, kh: int, kw: int, stride: int, pad: int
) -> cupy.ndarray:
    """The adjoint of :func:`im2col`: overlapping patches are summed back into an NCHW batch."""
    check_float("cols", cols)
    n, c, h, w, oh, ow = _window_geometry(x_shape, kh, kw, stride, pad)
    if cols.shape != (n * oh * ow, c * kh * kw):
        raise ValueError(f"cols of shape {cols.shape} do not match input {tuple(x_shape)}")
    cols = contiguous(cols)
    x = cupy.empty((n, c, h, w), cols.dtype)
    kernel = get_kernel("im2col.cu", "col2im", cols.dtype)
    launch(kernel, x.size, cols, x, n, c, h, w, kh, kw, stride, pad, oh, ow)
    return x


def conv2d_forward(
    x: cupy.ndarray, w: cupy.ndarray, b: cupy.ndarray, stride: int, pad: int, act: str
) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``(y, cols)``: ``y`` is NCHW; ``cols`` is kept for the backward pass."""
    common.check_conv(x, w, b, stride, pad)
    n, _, h, wd = x.shape
    o, _, kh, kw = w.shape
    oh, ow = conv_out_size(h, kh, stride, pad), conv_out_size(wd, kw, stride, pad)
    cols = im2col(x, kh, kw, stride, pad)
    z = bias_act_forward(matmul(cols, w.reshape(o, -1).T), b, act)  # (n*oh*ow, o)
    return cupy.ascontiguousarray(z.reshape(n, oh, ow, o).transpose(0, 3, 1, 2)), cols


def conv2d_backward(
    dy: cupy.ndarray,
    y: cupy.ndarray,
    cols: cupy.ndarray,
    w: cupy.ndarray,
    x_shape: tuple,
    stride: int,
    pad: int,
    act: str,
    need_dx: bool = True,
) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
    """``(dx, dw, db)`` of :func:`conv2d_forward`."""
    o, c, kh, kw = w.shape
    y2 = y.transpose(0, 2, 3, 1).reshape(-1, o)
    dy2 = dy.transpose(0, 2, 3, 1).reshape(-1, o)
    dz, db = bias_act_backward(dy2, y2, act)
    dw = matmul(dz.T, cols).reshape(w.shape)
    if not need_dx:
        return None, dw, db
    dx = col2im(matmul(dz, w.reshape(o, -1)), x_shape, kh, kw, stride, pad)
    return dx, dw, db


# ---------------------------------------------------------------- pooling


def _pool_grad_geometry(dy, x_shape: tuple, k: int, stride: int, pad: int) -> tuple:
    check_float("dy", dy)
    n, c, h, w, oh, ow = _window_geometry(x_shape, k, k, stride, pad)
    if dy.shape != (n, c, oh, ow):
        raise ValueError(f"dy of shape {dy.shape} does not match pooling {tuple(x_shape)}")
    return n * c, h, w, oh, ow


def maxpool_forward(
    x: cupy.ndarray, k: int, stride: int, pad: int
) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``(y, argmax)``; ``argmax`` is the int32 position in the window (first maximum wins)."""
    common.check_pool(x, k, stride, pad)
    n, c, h, w, oh, ow = _window_geometry(x.shape, k, k, stride, pad)
    x = contiguous(x)
    y = cupy.empty((n, c, oh, ow), x.dtype)
    arg = cupy.empty((n, c, oh, ow), cupy.int32)
    kernel = get_kernel("pool.cu", "maxpool_fwd", x.dtype)
    launch(kernel, y.size, x, y, arg, n * c, h, w, k, stride, pad, oh, ow)
    return y, arg


def maxpool_backward(
    dy: cupy.ndarray, argmax: cupy.ndarray, x_shape: tuple, k: int, stride: int, pad: int
) -> cupy.ndarray:
    nc, h, w, oh, ow = _pool_grad_geometry(dy, x_shape, k, stride, pad)
    if argmax.shape != dy.shape:
        raise ValueError(f"argmax of shape {argmax.shape} does not match dy {dy.shape}")
    dy, argmax = contiguous(dy), contiguous(argmax, cupy.int32)
    dx = cupy.empty(tuple(x_shape), dy.dtype)
    kernel = get_kernel("pool.cu", "maxpool_bwd", dy.dtype)
    launch(kernel, dx.size, dy, argmax, dx, nc, h, w, k, stride, pad, oh, ow)
    return dx


def avgpool_forward(x: cupy.ndarray, k: int, stride: int, pad: int) -> cupy.ndarray:
    """Average pooling; padded zeros count in the divisor (``count_include_pad``)."""
    common.check_pool(x, k, stride, pad)
    n, c, h, w, oh, ow = _window_geometry(x.shape, k, k, stride, pad)
    x = contiguous(x)
    y = cupy.empty((n, c, oh, ow), x.dtype)
    kernel = get_kernel("pool.cu", "avgpool_fwd", x.dtype)
    launch(kernel, y.size, x, y, n * c, h, w, k, stride, pad, oh, ow)
    return y


def avgpool_backward(
    dy: cupy.ndarray, x_shape: tuple, k: int, stride: int, pad: int
) -> cupy.ndarray:
    nc, h, w, oh, ow = _pool_grad_geometry(dy, x_shape, k, stride, pad)
    dy = contiguous(dy)
    dx = cupy.empty(tuple(x_shape), dy.dtype)
    kernel = get_kernel("pool.cu", "avgpool_bwd", dy.dtype)
    launch(kernel, dx.size, dy, dx, nc, h, w, k, stride, pad, oh, ow)
    return dx


# ---------------------------------------------------------------- dropout (counter-based)


def dropout_mask(
    x: cupy.ndarray, rate: float, key: int, sample_offset: int, key_offset=None
) -> cupy.ndarray:
    """The scaled keep-mask for ``x``, bit-identical to :func:`cpu.dropout_mask`.
    ``key_offset``: two uint64 in device memory, the key and the sample offset, read by the
    kernel in place of ``key`` and ``sample_offset`` (a replayed CUDA graph's step)."""
    check_float("x", x)
    thresh = dropout_threshold(rate)
    n = x.shape[0]
    per = x.size // n if n else 0
    out = cupy.empty(x.shape, x.dtype)
    scale = x.dtype.type(1.0 / (1.0 - rate))  # rounded from float64, as cpu.py does
    counter0 = np.uint64(sample_offset * per)
    kernel = get_kernel("dropout.cu", "dropout_mask", x.dtype)
    if key_offset is not None and (
        key_offset.dtype != np.uint64 or key_offset.size < 2 or not key_offset.flags.c_contiguous
    ):
        raise ValueError("key_offset must be 2 contiguous uint64 values on the device")
    dev = 0 if key_offset is None else key_offset
    launch(
        kernel, out.size, out, out.size, np.uint64(key), counter0, np.uint64(thresh), scale,
        dev, np.uint64(per),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------- batch normalisation


def _bn_dims(x) -> tuple[int, int, int]:
    """``(N, C, S)``: the kernels view ``x`` as ``(N, C, S)`` with ``S = H*W`` (1 for 2-D)."""
    return x.shape[0], x.shape[1], math.prod(x.shape[2:])


def batchnorm_forward_train(
    x: cupy.ndarray, gamma: cupy.ndarray, beta: cupy.ndarray, eps: float
) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray, cupy.ndarray]:
    """``(y, mean, var, inv_std)`` using the batch's statistics (``var`` is the biased one)."""
    common.check_bn(x, gamma, beta)
    x, gamma, beta = contiguous(x), contiguous(gamma), contiguous(beta)
    n, c, s = _bn_dims(x)
    mean, var, inv_std = (cupy.empty(c, x.dtype) for _ in range(3))
    stats = get_kernel("batchnorm.cu", "bn_stats", x.dtype)
    launch_blocks(stats, c, x, mean, var, inv_std, n, c, s, x.dtype.type(eps))
    y = cupy.empty_like(x)
    apply = get_kernel("batchnorm.cu", "bn_apply", x.dtype)
    launch(apply, x.size, x, mean, inv_std, gamma, beta, y, x.size, c, s)
    return y, mean, var, inv_std


def batchnorm_forward_infer(
    x: cupy.ndarray,
    gamma: cupy.ndarray,
    beta: cupy.ndarray,
    mean: cupy.ndarray,
    var: cupy.ndarray,
    eps: float,
) -> cupy.ndarray:
    common.check_bn(x, gamma, beta)
    n, c, s = _bn_dims(x)
    _check_vectors(c, mean=mean, var=var)
    x, beta, mean, var = (
        contiguous(x),
        contiguous(beta),
        contiguous(mean, x.dtype),
        contiguous(var, x.dtype),
    )
    inv_std = 1 / cupy.sqrt(var + x.dtype.type(eps))
    scale = contiguous(gamma * inv_std, x.dtype)
    y = cupy.empty_like(x)
    apply = get_kernel("batchnorm.cu", "bn_apply", x.dtype)
    launch(apply, x.size, x, mean, scale, cupy.ones(c, x.dtype), beta, y, x.size, c, s)
    return y


def batchnorm_backward(
    dy: cupy.ndarray,
    x: cupy.ndarray,
    gamma: cupy.ndarray,
    mean: cupy.ndarray,
    inv_std: cupy.ndarray,
) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
    """``(dx, dgamma, dbeta)`` of :func:`batchnorm_forward_train`."""
    common.check_bn(x, gamma, gamma)
    _check_like("x", x, dy=dy)
    n, c, s = _bn_dims(x)
    _check_vectors(c, mean=mean, inv_std=inv_std)
    check_same_dtype(x=x, mean=mean, inv_std=inv_std)
    dy, x, mean, inv_std = contiguous(dy), contiguous(x), contiguous(mean), contiguous(inv_std)
    m = n * s
    dgamma, dbeta = cupy.empty(c, x.dtype), cupy.empty(c, x.dtype)
    reduce = get_kernel("batchnorm.cu", "bn_bwd_reduce", x.dtype)
    launch_blocks(reduce, c, dy, x, mean, inv_std, dgamma, dbeta, n, c, s)
    k = contiguous(gamma * inv_std / m)
    dx = cupy.empty_like(x)
    grad = get_kernel("batchnorm.cu", "bn_bwd_dx", x.dtype)
    launch(grad, x.size, dy, x, mean, inv_std, k, dgamma, dbeta, dx, x.size, c, s, x.dtype.type(m))
    return dx, dgamma, dbeta
