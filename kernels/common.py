"""Checks and small helpers shared by the NumPy and CuPy ops.

Raw CUDA kernels check nothing, so every op validates shapes, dtypes and hyperparameters here,
before launch, with errors that name the offending argument.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

ACTIVATIONS = ("linear", "relu", "sigmoid", "tanh")
FLOAT_DTYPES = ("float32", "float64")
_MASK64 = (1 << 64) - 1


def check_activation(act: str) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activation {act!r}; expected one of {', '.join(ACTIVATIONS)}")


def check_float(name: str, a) -> None:
    if str(a.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or float64, got {a.dtype}")


def check_same_dtype(**arrays) -> None:
    dtypes = {name: str(a.dtype) for name, a in arrays.items()}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"dtypes differ: {dtypes}")


def check_bias(z, b) -> None:
    check_float("z", z)
    if z.ndim != 2 or b.shape != (z.shape[1],):
        raise ValueError(f"bias of shape {b.shape} does not match activations of shape {z.shape}")
    check_same_dtype(z=z, b=b)


def check_dense(x, w, b) -> None:
    check_float("x", x)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"dense: input {x.shape} does not match weight {w.shape}")
    if b.shape != (w.shape[1],):
        raise ValueError(f"dense: bias {b.shape} does not match weight {w.shape}")
    check_same_dtype(x=x, w=w, b=b)


def on_host(a) -> bool:
    """Whether ``a`` lives in host memory (a NumPy array), where reading its values to check
    them costs no wait for a GPU."""
    return not type(a).__module__.startswith("cupy")


def readable(a) -> bool:
    """Whether ``a``'s values may be read back to check them: not while a CUDA graph of a step
    is being recorded (a read would end the capture). A graph's inputs are checked on the host
    before they are staged (raysinga.run.graph_step)."""
    if on_host(a):
        return True
    import cupy  # noqa: PLC0415 - only for CuPy arrays

    return not cupy.cuda.get_current_stream().is_capturing()


def check_labels(logits, labels) -> None:
    """Shapes and dtype always; the labels' range only on the host: on a GPU, reading them
    back would wait for the device every step, so the data's labels are checked before
    training (:mod:`raysinga.data.check`) and the kernel gives a label out of range a NaN loss
    instead of reading outside its row."""
    check_float("logits", logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must be (batch, classes), got shape {logits.shape}")
    if labels.shape != (logits.shape[0],):
        raise ValueError(f"labels of shape {labels.shape} do not match logits {logits.shape}")
    if labels.dtype.kind not in "iu":
        raise TypeError(f"labels must be integers, got {labels.dtype}")
    if labels.size and on_host(labels) and (labels.min() < 0 or labels.max() >= logits.shape[1]):
        raise ValueError(
            f"labels must lie in [0, {logits.shape[1]}), got range "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )


def conv_out_size(size: int, k: int, stride: int, pad: int) -> int:
    out = (size + 2 * pad - k) // stride + 1
    if out < 1:
        raise ValueError(
            f"window {k} with stride {stride} and padding {pad} does not fit an input of "
            f"size {size}"
        )
    return out


def check_conv(x, w, b, stride: int, pad: int) -> None:
    check_float("x", x)
    if x.ndim != 4 or w.ndim != 4:
        raise ValueError(f"conv2d wants NCHW input and OCKK weight, got {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"conv2d: input has {x.shape[1]} channels, weight expects {w.shape[1]}")
    if b.shape != (w.shape[0],):
        raise ValueError(f"conv2d: bias {b.shape} does not match {w.shape[0]} filters")
    if stride < 1 or pad < 0:
        raise ValueError(f"conv2d: stride must be >= 1 and padding >= 0, got {stride}, {pad}")
    check_same_dtype(x=x, w=w, b=b)
    conv_out_size(x.shape[2], w.shape[2], stride, pad)
    conv_out_size(x.shape[3], w.shape[3], stride, pad)


def check_pool(x, k: int, stride: int, pad: int) -> None:
    check_float("x", x)
    if x.ndim != 4:
        raise ValueError(f"pooling wants an NCHW input, got shape {x.shape}")
    if k < 1 or stride < 1 or pad < 0 or 2 * pad > k:
        raise ValueError(
            f"pooling needs kernel >= 1, stride >= 1 and 0 <= padding <= kernel/2, "
            f"got kernel {k}, stride {stride}, padding {pad}"
        )
    conv_out_size(x.shape[2], k, stride, pad)
    conv_out_size(x.shape[3], k, stride, pad)


def check_bn(x, gamma, beta) -> None:
    check_float("x", x)
    if x.ndim not in (2, 4):
        raise ValueError(f"batch norm wants (N, C) or NCHW input, got shape {x.shape}")
    if gamma.shape != (x.shape[1],) or beta.shape != (x.shape[1],):
        raise ValueError(
            f"batch norm: gamma {gamma.shape} / beta {beta.shape} do not match "
            f"{x.shape[1]} channels"
        )
    check_same_dtype(x=x, gamma=gamma, beta=beta)


# ---------------------------------------------------------------- counter-based randomness


GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's stream increment
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64_array(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array, NumPy's or CuPy's (wrapping arithmetic), the
    same bits as :func:`mix64` and the kernels' ``mix64``: dropout masks, a layer's random
    stream, data order and synthetic data."""
    if not hasattr(z, "__cuda_array_interface__"):  # a CuPy array stays on its device
        z = np.asarray(z, dtype=np.uint64)
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def draws24(xp: Any, key: int, sample_offset: int, n: int, per: int) -> Any:
    """The 24-bit draws (uint64) of ``n`` samples of ``per`` elements each, the first being
    global sample ``sample_offset``: element ``j`` of sample ``s`` draws the top 24 bits of
    ``mix64(key + (s * per + j) * GOLDEN)``. Dropout's masks and a layer's random stream
    (``Layer.uniform``) are made of them, so a sample draws the same whoever computes it."""
    u64 = xp.uint64
    ctr = xp.arange(sample_offset * per, (sample_offset + n) * per, dtype=u64)
    with np.errstate(over="ignore"):
        return mix64_array(u64(key) + ctr * u64(GOLDEN)) >> u64(40)


def mix64(z: int) -> int:
    """SplitMix64's finaliser on a Python int (the same function the kernels use)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def dropout_key(seed: int, step: int, layer: str) -> int:
    """The 64-bit key of one dropout layer at one step: independent of who computes the batch."""
    k = mix64(seed ^ 0x243F6A8885A308D3)
    k = mix64(k + step)
    return mix64(k + zlib.crc32(layer.encode()))


def dropout_threshold(rate: float) -> int:
    """Elements whose 24-bit draw is below this are dropped."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    return int(round(rate * (1 << 24)))


def check_rows(name: str, a, width: int) -> None:
    if a.ndim != 2 or a.shape[1] != width:
        raise ValueError(f"{name} must have shape (rows, {width}), got {a.shape}")


def check_token_ids(idx, vocab: int) -> None:
    """Integer ids in ``[0, vocab)``: a kernel would read outside the table otherwise."""
    if idx.dtype.kind not in "iu":
        raise ValueError(f"token indices must be integers, got {idx.dtype}")
    if idx.size and readable(idx) and (int(idx.min()) < 0 or int(idx.max()) >= vocab):
        bad = idx[(idx < 0) | (idx >= vocab)][0]
        raise ValueError(f"token index {int(bad)} is outside the vocabulary [0, {vocab})")


def adam_step_values(
    lr: float, t: int, betas: tuple[float, float], weight_decay: float
) -> tuple[float, float, float]:
    """Adam's scalars of step ``t`` in double: ``(decay, neg_step, bc2)``, the kernel's
    arguments before they are rounded to the parameters' dtype."""
    beta1, beta2 = betas
    return 1 - lr * weight_decay, -(lr / (1 - beta1**t)), (1 - beta2**t) ** 0.5


def row_bounds(rows: int, blocks: int) -> list[int]:
    """The bounds of ``blocks`` blocks of ``rows`` rows (at most one per row), as even as can
    be: ``[0, ..., rows]`` (a dense layer's weight gradient by blocks: ``cpu.dense_backward``)."""
    k = max(1, min(blocks, rows))
    return [rows * i // k for i in range(k + 1)]
