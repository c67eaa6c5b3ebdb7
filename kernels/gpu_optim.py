"""CuPy fused updates: the optimizers' steps and the parameter-server stub's gradient sum.

Not twins of ``cpu.py`` ops, so they live apart from ``gpu.py``'s layer ops: their references are
the NumPy updates of raysinga.optim.optimizers and the stub's NumPy sum, which these match bit for
bit (see optim.cu, compiled without fused multiply-adds). Each updates its arrays in place in
one launch.
"""

from __future__ import annotations

import cupy
import numpy as np

from .common import adam_step_values, check_float
from .gpu_launch import contiguous, get_kernel, launch


def _check_flat(name: str, a, **others) -> None:
    """Arrays updated in place by one launch: C-contiguous, same size and dtype as ``a``."""
    check_float(name, a)
    for n, x in {name: a, **others}.items():
        if not x.flags.c_contiguous:
            raise ValueError(f"{n} must be C-contiguous to be updated in place")
        if x.size != a.size or x.dtype != a.dtype:
            raise ValueError(
                f"{n} ({x.size} x {x.dtype}) does not match {name} ({a.size} x {a.dtype})"
            )


def sgd_update(
    param,
    grad,
    buf,
    lr: float,
    momentum: float,
    weight_decay: float,
    nesterov: bool,
    step=None,
    copy=None,
):
    """One SGD step on ``param`` (and its momentum ``buf``, or None) in place, in one launch.
    ``step``: a float64 device array whose element 0 is the rate, read by the kernel in place of
    ``lr`` (what a replayed CUDA graph needs: the rate of the step it runs). ``copy``: a uint16
    array that receives the updated parameter's bfloat16 words in the same pass."""
    grad = contiguous(grad, param.dtype)
    _check_flat("param", param, grad=grad, **({} if buf is None else {"buf": buf}))
    t = param.dtype.type
    k = get_kernel("optim.cu", "sgd_update", param.dtype)
    args = (param, grad, 0 if buf is None else buf, param.size, t(lr), t(momentum))
    flags = (int(buf is not None), int(nesterov))
    launch(k, param.size, *args, t(weight_decay), *flags, _step_values(step, 1), _copy(param, copy))


def adam_update(
    param,
    grad,
    m,
    v,
    lr: float,
    t: int,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    step=None,
    copy=None,
) -> None:
    """One Adam (``decoupled``: AdamW) step ``t`` on ``param``, ``m`` and ``v`` in place, in one
    launch. Scalars are computed in double and rounded to the dtype, as NumPy does. ``step``: a
    float64 device array holding what changes from step to step, :func:`adam_step_values`,
    read by the kernel in place of ``lr`` and ``t`` (a replayed CUDA graph's step). ``copy``: as
    :func:`sgd_update`'s."""
    grad = contiguous(grad, param.dtype)
    _check_flat("param", param, grad=grad, m=m, v=v)
    beta1, beta2 = betas
    T = param.dtype.type  # noqa: N806 - the kernel's T
    w = 1 - beta1
    decay, neg_step, bc2 = adam_step_values(lr, t, betas, weight_decay)
    k = get_kernel("optim.cu", "adam_update", param.dtype)
    launch(
        k,
        param.size,
        param,
        grad,
        m,
        v,
        param.size,
        T(decay),
        int(bool(weight_decay) and decoupled),
        T(weight_decay),
        T(w),
        T(1.0 - w),
        int(abs(w) >= 0.5),
        T(beta2),
        T(1 - beta2),
        T(neg_step),
        T(bc2),
        T(eps),
        _step_values(step, 3),
        _copy(param, copy),
    )


def _step_values(step, n: int):
    """A device array of at least ``n`` float64 values, or 0 (a null pointer) for None."""
    if step is None:
        return 0
    if step.dtype != np.float64 or step.size < n or not step.flags.c_contiguous:
        raise ValueError(f"step must be {n} contiguous float64 values on the device")
    return step


def _copy(param, copy):
    """The bfloat16 copy's device array for a kernel, or 0 (a null pointer) for None."""
    if copy is None:
        return 0
    if param.dtype != np.float32:
        raise TypeError(f"a bfloat16 copy is of a float32 parameter, not of {param.dtype}")
    if copy.dtype != np.uint16 or copy.size != param.size or not copy.flags.c_contiguous:
        raise ValueError(f"copy must be {param.size} contiguous uint16 words on the device")
    return copy


def weighted_sum(out, buffers: list, weights=None):
    """``out`` = the sum, in list order, of ``weights[j] * buffers[j]`` (None: plain sum, as the
    stub's NumPy sum), in one pass over the buffers."""
    if not buffers:
        raise ValueError("weighted_sum needs at least one buffer")
    _check_flat("out", out, **{f"buffers[{j}]": b for j, b in enumerate(buffers)})
    if weights is not None:
        weights = contiguous(weights, out.dtype)
        if weights.shape != (len(buffers),):
            raise ValueError(f"weights must have shape ({len(buffers)},), got {weights.shape}")
    ptrs = cupy.asarray(np.array([b.data.ptr for b in buffers], dtype=np.uint64))
    k = get_kernel("optim.cu", "weighted_sum", out.dtype)
    launch(k, out.size, out, ptrs, 0 if weights is None else weights, len(buffers), out.size)
    return out
