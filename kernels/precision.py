"""The compute precision of matrix products: float32, TF32 or bf16 inputs with float32 sums.

A process computes its matrix products (dense layers, convolutions through im2col, attention,
recurrent cells) in one precision, set once by whoever runs the steps (the single-process
trainer, a worker) from the job's ``precision.compute``:

- ``f32``: float32 operands (the default; and the only choice for float64 runs).
- ``tf32``: operands rounded to TF32 (10 mantissa bits, as the tensor cores read them), products
  summed in float32. On a GPU, cuBLAS's TF32 tensor-core mode.
- ``bf16``: operands rounded to bfloat16 (7 mantissa bits), products summed in float32. On a GPU
  the operands are cast to 16-bit words and cuBLAS multiplies them on the tensor cores.

Everything else (activations, softmax, layer and batch norm and their statistics, losses,
reductions, gradients' sums, the optimizer and its master weights) stays float32.

On a CPU the reduced precisions are emulated: the operands are rounded here, with NumPy, and the
BLAS multiplies them in float32. A bf16 product of two bf16 numbers is exact in float32, so this
computes what the GPU computes up to the order of the float32 sums. It is slower than float32 on
a CPU, and exists so that a job's numerics can be run and tested anywhere (a run says so in one
line). Rounding is to nearest, ties to even for bf16 (as ``ml_dtypes.bfloat16`` rounds, which
the tests check) and ties away from zero for TF32 (as the GPU's ``cvt.rna.tf32.f32``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

POLICIES = ("f32", "tf32", "bf16")
_compute = "f32"


def use(policy: str) -> None:
    """Set this process's compute precision (one of :data:`POLICIES`)."""
    global _compute
    if policy not in POLICIES:
        raise ValueError(f"precision.compute must be one of {', '.join(POLICIES)}, got {policy!r}")
    _compute = policy


def compute() -> str:
    """This process's compute precision."""
    return _compute


@contextlib.contextmanager
def using(policy: str) -> Iterator[None]:
    """:func:`use` for the duration of a block, the earlier policy restored after."""
    before = _compute
    use(policy)
    try:
        yield
    finally:
        use(before)


def emulation_note(policy: str, device: str) -> str | None:
    """One line for a run whose reduced precision is emulated (on a CPU), else None; raises
    where a GPU cannot run the policy (cuBLAS's binding missing)."""
    if policy == "f32":
        return None
    if device == "gpu":
        from .blas_plan import binding_error  # noqa: PLC0415

        error = binding_error()
        if error is not None:
            raise RuntimeError(
                f"precision.compute: {policy} on a GPU needs cuBLAS's bindings: {error}; "
                "pip install 'raysinga[gpu]'"
            )
        return None
    return (
        f"raysinga: precision.compute: {policy} on the CPU is emulated (operands rounded to "
        f"{policy}, products summed in float32 by the BLAS): slower than f32 there; a GPU "
        "runs it on its tensor cores"
    )


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to bfloat16, as 16-bit words (round to nearest, ties to even;
    NaN stays NaN, quiet, with its sign)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    with np.errstate(over="ignore"):
        rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (u >> np.uint32(16)) | np.uint32(0x40)
    return np.where(nan, quiet, rounded).astype(np.uint16)


def from_bf16_bits(h: np.ndarray) -> np.ndarray:
    """16-bit bfloat16 words as float32 (exact)."""
    return (np.asarray(h, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to the nearest bfloat16, as float32."""
    return from_bf16_bits(bf16_bits(x)).reshape(np.shape(x))


def round_tf32(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to TF32 (ties away from zero), as float32; NaN and infinities as
    they are."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    finite = (u & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    with np.errstate(over="ignore"):
        rounded = (u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return np.where(finite, rounded, u).view(np.float32).reshape(np.shape(x))


def operand(x: Any) -> Any:
    """A NumPy matrix product's operand in this process's precision (as it is for ``f32`` and
    for float64, which has no reduced form here)."""
    if _compute == "f32" or x.dtype != np.float32:
        return x
    return round_bf16(x) if _compute == "bf16" else round_tf32(x)
