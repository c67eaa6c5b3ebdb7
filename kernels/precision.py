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

Under ``bf16``, the run's weights (its float32 parameters of two or more axes) have bfloat16
copies (:class:`WeightCopies`), written by the optimizer in the pass that updates the weight
(the fused kernels of ``optim.cu``) or, where the values come from elsewhere (a worker's from
the servers), once per step: a matrix product reads a weight's copy, or the view of it that
matches its operand, in place of casting the weight at every use (the forward and the backward
pass each read every weight at least once).

On a CPU the reduced precisions are emulated: the operands are rounded here, with NumPy, and the
BLAS multiplies them in float32. A bf16 product of two bf16 numbers is exact in float32, so this
computes what the GPU computes up to the order of the float32 sums. It is slower than float32 on
a CPU, and exists so that a job's numerics can be run and tested anywhere (a run says so in one
line). Rounding is to nearest, ties to even for bf16 (as ``ml_dtypes.bfloat16`` rounds, which
the tests check) and ties away from zero for TF32 (as the GPU's ``cvt.rna.tf32.f32``). A GPU's
bf16 products read words rounded alike (raysinga casts them); cuBLAS's TF32 mode converts the
float32 operands itself, and does not say how (rounded or cut), so an emulated TF32 run
follows a GPU's to the operands' conversion, not bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

POLICIES = ("f32", "tf32", "bf16")
_HIGH = 1 if np.little_endian else 0  # the 16-bit half of a 32-bit word that holds its top
_compute = "f32"
_copies: WeightCopies | None = None  # the weights' bf16 copies the matrix products read


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
    NaN stays NaN, quiet, with its sign and the top of its payload, as the CUDA kernels
    keep it).

    In place on one 32-bit temporary: add 0x7FFF and the lowest bit kept, then take the top
    halves of the words (a strided copy). On 8 MB that costs what ``ml_dtypes``' cast in C does
    (3.9 ms here), with the same bits (tests/kernels/test_precision.py checks against it), and
    spares every process the 1.2 s of CPU that importing ``ml_dtypes`` costs (it registers
    its ufunc loops one by one); a role's start-up is a replacement's time."""
    x = np.ascontiguousarray(x, np.float32)
    u = x.reshape(-1).view(np.uint32)
    t = np.right_shift(u, np.uint32(16))
    np.bitwise_and(t, np.uint32(1), out=t)
    t += np.uint32(0x7FFF)
    t += u  # wraps only for NaN words, set below
    words = t.view(np.uint16)[_HIGH::2].copy()
    nan = np.isnan(x.reshape(-1))
    if nan.any():
        words[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return words.reshape(x.shape)


def from_bf16_bits(h: np.ndarray) -> np.ndarray:
    """16-bit bfloat16 words as float32 (exact): each word shifted into the top half of a
    32-bit one, in one pass."""
    h = np.asarray(h, np.uint16)
    return np.left_shift(h, np.uint32(16), dtype=np.uint32).view(np.float32)


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
    for float64, which has no reduced form here); under ``bf16``, a weight's copy where it has
    one (exactly the rounded weight)."""
    if _compute == "f32" or x.dtype != np.float32:
        return x
    if _compute == "tf32":
        return round_tf32(x)
    words = copy_of(x)
    return round_bf16(x) if words is None else from_bf16_bits(words)


def copy_of(x: Any) -> Any:
    """The bfloat16 words of ``x`` where it is (a view of) a weight with a copy in use, as
    the same view of the copy; else None."""
    return None if _copies is None or _compute != "bf16" else _copies.view_of(x)


@contextlib.contextmanager
def copies_in_use(copies: WeightCopies | None) -> Iterator[None]:
    """Have this process's matrix products read ``copies`` (None: none) for a block."""
    global _copies
    before, _copies = _copies, copies
    try:
        yield
    finally:
        _copies = before


def write_copy(param: Any, words: Any) -> None:
    """``words`` = the bfloat16 words of float32 ``param`` (same shape; NumPy or CuPy)."""
    if isinstance(param, np.ndarray):
        words[...] = bf16_bits(param).reshape(param.shape)
        return
    from .gpu_launch import get_kernel, launch  # noqa: PLC0415 - CuPy, only for CuPy arrays

    if not (param.flags.c_contiguous and words.flags.c_contiguous) or words.size != param.size:
        raise ValueError("a bf16 copy is written from and into C-contiguous arrays of one size")
    launch(get_kernel("precision.cu", "to_bf16", param.dtype), param.size, param, words, param.size)


def words_of(x: Any) -> Any:
    """A new C-contiguous array of the bfloat16 words of float32 ``x`` (NumPy or CuPy)."""
    xp = np if isinstance(x, np.ndarray) else _module_of(x)
    x = xp.ascontiguousarray(x)
    words = xp.empty(x.shape, np.uint16)
    write_copy(x, words)
    return words


def _address(a: Any) -> int:
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


class WeightCopies:
    """bfloat16 copies of a run's weights: of each float32 parameter of two or more axes, a
    uint16 array of its shape on its device, and :meth:`view_of`, which finds the copy of a view
    of a weight (a transpose in the backward pass, a slice). Whoever changes a weight writes its
    copy: the optimizer as it updates it (``Optimizer.bf16_copies``), else :meth:`refresh`."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = {  # (a weight laid out otherwise is cast where it is used, as before)
            k: p
            for k, p in params.items()
            if p.dtype == np.float32 and p.ndim >= 2 and p.size and p.flags.c_contiguous
        }
        self.words: dict[str, Any] = {}
        for k, p in self.params.items():
            xp = np if isinstance(p, np.ndarray) else _module_of(p)
            self.words[k] = xp.empty(p.shape, np.uint16)
        self._spans = sorted(
            (_address(p), _address(p) + p.nbytes, k) for k, p in self.params.items()
        )
        self.refresh()

    def refresh(self, names: Any = None) -> None:
        """Write the copies of ``names`` (default: every weight) from the weights' values."""
        for k in self.params if names is None else names:
            if k in self.words:
                write_copy(self.params[k], self.words[k])

    def view_of(self, x: Any) -> Any:
        """The copy's view that matches ``x``, a view of one weight (same device), or None."""
        if x.dtype != np.float32 or not x.size:
            return None
        start = _address(x)
        span = next((sp for sp in self._spans if sp[0] <= start < sp[1]), None)
        if span is None:
            return None
        lo, hi, k = span
        p, words = self.params[k], self.words[k]
        if type(x) is not type(p) or any(s % 4 for s in x.strides) or (start - lo) % 4:
            return None
        last = start + sum((n - 1) * st for n, st in zip(x.shape, x.strides, strict=True) if st > 0)
        if min(x.strides, default=0) < 0 or last + 4 > hi:
            return None
        # the copy's words lie where the weight's floats lie, at half the bytes
        off, strides = (start - lo) // 2, tuple(st // 2 for st in x.strides)
        if isinstance(words, np.ndarray):
            base = words.reshape(-1)[off // 2 :]
            return np.lib.stride_tricks.as_strided(base, x.shape, strides, writeable=False)
        cp = _module_of(words)
        return cp.ndarray(x.shape, np.uint16, memptr=words.data + off, strides=strides)


def _module_of(a: Any) -> Any:
    import cupy  # noqa: PLC0415 - only for CuPy arrays

    return cupy
