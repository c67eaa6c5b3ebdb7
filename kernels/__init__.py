"""Array ops for raysinga's layers, on NumPy (CPU) or CuPy raw CUDA kernels (GPU).

Each op exists twice with one signature, in ``cpu.py`` and ``gpu.py``; the functions exported here
pick the implementation from the arrays they are given, so a layer is written once. This package
imports nothing of raysinga and nothing of Ray.
"""

from __future__ import annotations

import functools
from typing import Any

from . import common, cpu
from .backend import (
    cupy_module,
    device,
    get_array_module,
    gpu_available,
    gpu_unavailable_reason,
    to_device,
    to_numpy,
    xp_for,
)
from .common import ACTIVATIONS, dropout_key

OPS = (
    "activation_forward",
    "activation_backward",
    "bias_act_forward",
    "bias_act_backward",
    "dense_forward",
    "dense_backward",
    "softmax_xent_forward",
    "softmax_xent_backward",
    "im2col",
    "col2im",
    "conv2d_forward",
    "conv2d_backward",
    "maxpool_forward",
    "maxpool_backward",
    "avgpool_forward",
    "avgpool_backward",
    "dropout_mask",
    "batchnorm_forward_train",
    "batchnorm_forward_infer",
    "batchnorm_backward",
)


def _gpu_module() -> Any:
    from . import gpu  # noqa: PLC0415 - needs CuPy, imported only when a CuPy array shows up

    return gpu


def _dispatch(name: str):
    cpu_fn = getattr(cpu, name)

    @functools.wraps(cpu_fn)
    def op(*args, **kwargs):
        if get_array_module(*args, *kwargs.values()) is not cpu.np:
            return getattr(_gpu_module(), name)(*args, **kwargs)
        return cpu_fn(*args, **kwargs)

    return op


activation_forward = _dispatch("activation_forward")
activation_backward = _dispatch("activation_backward")
bias_act_forward = _dispatch("bias_act_forward")
bias_act_backward = _dispatch("bias_act_backward")
dense_forward = _dispatch("dense_forward")
dense_backward = _dispatch("dense_backward")
softmax_xent_forward = _dispatch("softmax_xent_forward")
softmax_xent_backward = _dispatch("softmax_xent_backward")
im2col = _dispatch("im2col")
col2im = _dispatch("col2im")
conv2d_forward = _dispatch("conv2d_forward")
conv2d_backward = _dispatch("conv2d_backward")
maxpool_forward = _dispatch("maxpool_forward")
maxpool_backward = _dispatch("maxpool_backward")
avgpool_forward = _dispatch("avgpool_forward")
avgpool_backward = _dispatch("avgpool_backward")
dropout_mask = _dispatch("dropout_mask")
batchnorm_forward_train = _dispatch("batchnorm_forward_train")
batchnorm_forward_infer = _dispatch("batchnorm_forward_infer")
batchnorm_backward = _dispatch("batchnorm_backward")

__all__ = [
    *OPS,
    "ACTIVATIONS",
    "common",
    "cupy_module",
    "device",
    "dropout_key",
    "get_array_module",
    "gpu_available",
    "gpu_unavailable_reason",
    "to_device",
    "to_numpy",
    "xp_for",
]
