"""How ``gpu.py`` and ``gpu_optim.py`` reach the raw CUDA kernels: loading, compiling, launching.

Kept apart from the ops so that the tables of kernel files and entry points, the NVRTC options and
the launch geometry live in one place, whichever module launches a kernel. Imports CuPy, so, like
``gpu.py``, it is imported only once a CuPy array shows up.
"""

from __future__ import annotations

from importlib import resources

import cupy
import numpy as np

BLOCK = 256  # threads per block; the block reductions in the .cu files assume exactly this
MAX_GRID = 65535  # blocks per launch; grid-stride loops cover the rest

# Entry points per kernel file; each exists as NAME_f32 and NAME_f64. A plain literal:
# tests/kernels/test_cuda_compile.py reads it without importing this module.
KERNELS = {
    "activation.cu": ("act_fwd", "bias_act_fwd", "act_bwd", "col_sum", "act_bwd_col_sum"),
    "softmax_xent.cu": ("xent_fwd", "xent_bwd", "xent_grad"),
    "im2col.cu": ("im2col", "col2im"),
    "pool.cu": ("maxpool_fwd", "maxpool_bwd", "avgpool_fwd", "avgpool_bwd"),
    "dropout.cu": ("dropout_mask",),
    "batchnorm.cu": ("bn_stats", "bn_apply", "bn_bwd_reduce", "bn_bwd_dx"),
    "optim.cu": ("sgd_update", "adam_update", "weighted_sum"),
    "precision.cu": ("to_bf16", "from_bf16"),
    "attention.cu": ("attn_fwd", "attn_bwd_delta", "attn_bwd_dq", "attn_bwd_dkv"),
    "seq.cu": (
        "emb_fwd",
        "emb_count",
        "emb_order",
        "emb_bwd",
        "ln_fwd",
        "ln_bwd",
        "rms_fwd",
        "rms_bwd",
        "gelu_fwd",
        "gelu_bwd",
        "csoftmax_fwd",
        "csoftmax_bwd",
        "gru_fwd",
        "gru_bwd",
        "lstm_fwd",
        "lstm_bwd",
    ),
}
# NVRTC options of every file; a plain literal too. Without fused multiply-adds each product is
# rounded before it is added, as NumPy rounds it: the optimizer updates and the gradient sum are
# bit-identical to the CPU path, and a difference that cancels exactly in real arithmetic (layer
# norm's ``dy * gamma - mean(dy * gamma)`` over one feature) is exactly zero, not the rounding
# error of a contracted product amplified by ``rstd``.
NVRTC_OPTIONS = ("-std=c++14", "--fmad=false")
# Entry points whose PTX may still hold fused multiply-adds: they call libdevice's exp, tanh or
# log, which use them internally (and are accurate to an ulp or two either way). Every other entry
# point must have none; tests/kernels/test_cuda_compile.py checks the PTX.
LIBDEVICE_FMA = {
    "activation.cu": ("act_fwd", "bias_act_fwd"),
    "softmax_xent.cu": ("xent_fwd", "xent_grad"),
    "seq.cu": ("gelu_fwd", "csoftmax_fwd", "gru_fwd", "lstm_fwd", "lstm_bwd"),
    "attention.cu": ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkv"),
}
_SUFFIX = {"float32": "f32", "float64": "f64"}


@cupy.memoize(for_each_device=True)
def _compile(filename: str) -> dict:
    """All entry points of one .cu file, compiled once per device by NVRTC."""
    src = resources.files("raysinga.kernels").joinpath(filename).read_text()
    module = cupy.RawModule(code=src, options=NVRTC_OPTIONS)
    return {
        f"{name}_{suf}": module.get_function(f"{name}_{suf}")
        for name in KERNELS[filename]
        for suf in _SUFFIX.values()
    }


def get_kernel(filename: str, name: str, dtype) -> cupy.RawKernel:
    """The entry point ``name`` of ``filename`` for ``dtype`` (float32 or float64)."""
    return _compile(filename)[f"{name}_{_SUFFIX[str(dtype)]}"]


def _args(args: tuple) -> tuple:
    # Kernel integers are long long (uint64 where wrapping matters); an int32 passed as is would
    # hand the kernel 4 bytes where it reads 8.
    return tuple(np.int64(a) if isinstance(a, (int, np.signedinteger)) else a for a in args)


def launch(kernel, n: int, *args) -> None:
    """A grid-stride launch over ``n`` items (nothing to launch for an empty array)."""
    if n > 0:
        kernel((min(-(-n // BLOCK), MAX_GRID),), (BLOCK,), _args(args))


def launch_blocks(kernel, nblocks: int, *args) -> None:
    """One block per row or channel (kernels loop over the rest beyond ``MAX_GRID``)."""
    if nblocks > 0:
        kernel((min(nblocks, MAX_GRID),), (BLOCK,), _args(args))


def contiguous(a, dtype=None) -> cupy.ndarray:
    """``a`` as a C-contiguous CuPy array: raw kernels index flat memory and check nothing."""
    return cupy.ascontiguousarray(cupy.asarray(a), dtype=dtype)
