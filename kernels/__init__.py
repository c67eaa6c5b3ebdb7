"""Array ops for raysinga's layers, on NumPy (CPU) or CuPy raw CUDA kernels (GPU).

Each op exists twice with one signature, in ``cpu.py`` and ``gpu.py``; the functions exported here
pick the implementation from the arrays they are given, so a layer is written once. This package
imports nothing of raysinga and nothing of Ray.
"""

from __future__ import annotations

import functools
from typing import Any

from . import common, cpu, cpu_seq
from .backend import (
    cupy_module,
    device,
    get_array_module,
    gpu_available,
    gpu_fallback_note,
    gpu_unavailable_reason,
    to_device,
    to_numpy,
    xp_for,
)
from .common import ACTIVATIONS, dropout_key, row_bounds
from .user import elementwise as elementwise_kernel
from .user import raw as raw_kernel

OPS = (
    "activation_forward",
    "activation_backward",
    "bias_act_forward",
    "bias_act_backward",
    "matmul",
    "dense_forward",
    "dense_backward",
    "softmax_xent_forward",
    "softmax_xent_backward",
    "softmax_xent",
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
SEQ_OPS = (  # cpu_seq.py / gpu_seq.py
    "embedding_forward",
    "embedding_backward",
    "layernorm_forward",
    "layernorm_backward",
    "rmsnorm_forward",
    "rmsnorm_backward",
    "gelu_forward",
    "gelu_backward",
    "causal_softmax_forward",
    "causal_softmax_backward",
    "gru_cell_forward",
    "gru_cell_backward",
    "lstm_cell_forward",
    "lstm_cell_backward",
)


def _gpu_module(seq: bool = False) -> Any:
    # needs CuPy: imported only when a CuPy array shows up
    if seq:
        from . import gpu_seq  # noqa: PLC0415

        return gpu_seq
    from . import gpu  # noqa: PLC0415

    return gpu


def _dispatch(name: str):
    seq = name in SEQ_OPS
    cpu_fn = getattr(cpu_seq if seq else cpu, name)

    @functools.wraps(cpu_fn)
    def op(*args, **kwargs):
        if get_array_module(*args, *kwargs.values()) is not cpu.np:
            return getattr(_gpu_module(seq), name)(*args, **kwargs)
        return cpu_fn(*args, **kwargs)

    return op


activation_forward = _dispatch("activation_forward")
activation_backward = _dispatch("activation_backward")
bias_act_forward = _dispatch("bias_act_forward")
bias_act_backward = _dispatch("bias_act_backward")
matmul = _dispatch("matmul")
dense_forward = _dispatch("dense_forward")
dense_backward = _dispatch("dense_backward")
softmax_xent_forward = _dispatch("softmax_xent_forward")
softmax_xent_backward = _dispatch("softmax_xent_backward")
softmax_xent = _dispatch("softmax_xent")
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
embedding_forward = _dispatch("embedding_forward")
embedding_backward = _dispatch("embedding_backward")
layernorm_forward = _dispatch("layernorm_forward")
layernorm_backward = _dispatch("layernorm_backward")
rmsnorm_forward = _dispatch("rmsnorm_forward")
rmsnorm_backward = _dispatch("rmsnorm_backward")
gelu_forward = _dispatch("gelu_forward")
gelu_backward = _dispatch("gelu_backward")
causal_softmax_forward = _dispatch("causal_softmax_forward")
causal_softmax_backward = _dispatch("causal_softmax_backward")
gru_cell_forward = _dispatch("gru_cell_forward")
gru_cell_backward = _dispatch("gru_cell_backward")
lstm_cell_forward = _dispatch("lstm_cell_forward")
lstm_cell_backward = _dispatch("lstm_cell_backward")


# Causal self-attention in one fused pass exists on the GPU only: in float32, raysinga's kernels
# (gpu_attention.py); in bf16, cuDNN's flash attention (gpu_cudnn_attention.py). On a CPU the
# BLAS products around the softmax are the fast way, and the layer keeps that path there.
def fused_attention_fits(qkv: Any, head_dim: int) -> bool:
    """Whether the attention over the projection ``qkv`` ``(n, T, 3 * heads * head_dim)`` runs
    as one fused pass: a CuPy array, and float32 products with heads raysinga's kernels take,
    or bf16 products that cuDNN takes (TF32 runs keep their matrix products)."""
    if get_array_module(qkv) is cpu.np:
        return False
    from . import gpu_attention, precision  # noqa: PLC0415 - gpu_attention imports CuPy

    policy = precision.compute()
    if policy == "f32":
        return gpu_attention.supports(head_dim, qkv.dtype)
    if policy == "bf16" and qkv.ndim == 3:
        from . import gpu_cudnn_attention  # noqa: PLC0415

        return gpu_cudnn_attention.fits(qkv, qkv.shape[-1] // (3 * head_dim))
    return False


def _fused_attention():
    from . import gpu_attention, gpu_cudnn_attention, precision  # noqa: PLC0415 - CuPy

    return gpu_cudnn_attention if precision.compute() == "bf16" else gpu_attention


def fused_attention_forward(qkv: Any, heads: int, scale: float) -> tuple[Any, Any]:
    """The heads' outputs, and what the backward pass takes back (each row's log-sum-exp in
    float32; cuDNN's operands and statistics in bf16)."""
    return _fused_attention().attention_forward(qkv, heads, scale)


def fused_attention_backward(
    dout: Any, qkv: Any, out: Any, saved: Any, heads: int, scale: float
) -> Any:
    """The gradient with respect to ``qkv``, laid out as ``qkv``."""
    return _fused_attention().attention_backward(dout, qkv, out, saved, heads, scale)


__all__ = [
    *OPS,
    *SEQ_OPS,
    "ACTIVATIONS",
    "common",
    "cupy_module",
    "device",
    "dropout_key",
    "elementwise_kernel",
    "fused_attention_backward",
    "fused_attention_fits",
    "fused_attention_forward",
    "get_array_module",
    "gpu_available",
    "gpu_fallback_note",
    "gpu_unavailable_reason",
    "raw_kernel",
    "row_bounds",
    "to_device",
    "to_numpy",
    "xp_for",
]
