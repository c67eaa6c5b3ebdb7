"""Matrix products through cuBLAS on a handle of raysinga's own, which a CUDA graph can capture.

CuPy refuses every cuBLAS call while a stream captures (cupy/cupy#6290), although cuBLAS itself
supports capture once the handle is bound to the capturing stream and given a workspace of its
own (the cuBLAS documentation, "CUDA Graphs Support"). This module does exactly that through
NVIDIA's nvmath-python bindings (``nvmath.bindings.cublas``): one handle per device, bound to the
current stream before each call, with a fixed workspace allocated once and never freed, so that a
captured product reads and writes the same memory at every replay. A product depends only on its
shapes, the handle's settings and the workspace, so an uncaptured call and its captured replay
give the same bits.

:func:`matmul` takes what ``cupy.matmul`` takes in a training step: 2-d products, batches with
broadcasting, operands that are transposed or strided views (read in place where cuBLAS can
address them, copied otherwise), and an ``out`` that may itself be a strided view.
"""

from __future__ import annotations

import threading

import cupy
import numpy as np

from . import precision
from .blas_plan import addressable, binding_error, plan, writable

import_error = binding_error  # why the bindings cannot be used here, or None

# The workspace cuBLAS may use per call: 32 MiB is what its documentation recommends on Hopper
# (4 MiB suffices before it); one per device, alive as long as the process.
WORKSPACE_BYTES = 32 << 20

_lock = threading.Lock()
_handles: dict[int, _Handle] = {}
_active = False


def use(on: bool) -> None:
    """Send the GPU ops' matrix products here (True) or to CuPy's (False, the default). A run
    with CUDA graphs turns it on before its first step, so that the step it records and the
    uncaptured steps before it compute the same products."""
    global _active
    _active = bool(on)


def active() -> bool:
    return _active


class _Handle:
    """A cuBLAS handle of one device, its workspace and the stream it was last bound to."""

    def __init__(self) -> None:
        from nvmath.bindings import cublas  # noqa: PLC0415 - optional dependency

        self.cublas = cublas
        self.ptr = cublas.create()
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
        self.stream = None
        # Host-pointer-mode scalars: read when a call is made (or captured), constant here.
        self.one = {np.dtype(t): np.ones(1, t) for t in (np.float32, np.float64)}
        self.zero = {np.dtype(t): np.zeros(1, t) for t in (np.float32, np.float64)}

    def bind(self) -> None:
        """Bind the handle to the current stream. cublasSetStream resets the workspace to the
        library's pool, so the fixed one is set again after every change of stream."""
        stream = cupy.cuda.get_current_stream().ptr
        if stream != self.stream:
            self.cublas.set_stream(self.ptr, stream)
            self.cublas.set_workspace(self.ptr, self.workspace.data.ptr, WORKSPACE_BYTES)
            self.stream = stream


def usable_error() -> str | None:
    """Why matrix products through this module cannot run on the current device, or None.
    Beyond the bindings' import (:data:`import_error`): the handle is made, and one small
    product computed and checked, since a missing or mismatched cuBLAS library first fails
    there, not at import."""
    error = import_error()
    if error is not None:
        return error
    try:
        a = cupy.arange(6, dtype=cupy.float64).reshape(2, 3)
        got = cupy.asnumpy(matmul(a, a.T))
    except Exception as e:  # noqa: BLE001 - whatever the library raised is the reason
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"cuBLAS through nvmath-python failed ({type(e).__name__}: {first})"
    if not np.array_equal(got, [[5.0, 14.0], [14.0, 50.0]]):
        return "a matrix product through cuBLAS came out wrong"
    return None


def _handle() -> _Handle:
    dev = cupy.cuda.runtime.getDevice()
    h = _handles.get(dev)
    if h is None:
        with _lock:
            h = _handles.get(dev)
            if h is None:
                h = _handles[dev] = _Handle()
    h.bind()
    return h


def matmul(a: cupy.ndarray, b: cupy.ndarray, out: cupy.ndarray | None = None) -> cupy.ndarray:
    """``a @ b`` (NumPy's matmul rules for arrays of at least two axes) through the capturable
    handle; written into ``out`` where given (any strides), else into a new C-contiguous array.
    float32 and float64. Operands cuBLAS cannot address as they lie are copied first (a copy a
    graph captures like any kernel)."""
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul needs operands of >= 2 axes, got {a.shape} and {b.shape}")
    if a.dtype != b.dtype or a.dtype not in (np.float32, np.float64):
        raise TypeError(f"matmul needs two float32 or two float64 arrays, got {a.dtype}, {b.dtype}")
    if out is not None and out.dtype != a.dtype:
        raise ValueError(f"matmul: out is {out.dtype}, the operands {a.dtype}")
    m, k = a.shape[-2:]
    if b.shape[-2] != k:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align")
    shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), m, b.shape[-1])
    if out is None:
        out = cupy.empty(shape, a.dtype)
    elif out.shape != shape:
        raise ValueError(f"matmul: out {out.shape} is not {shape}")
    if out.size == 0:
        return out
    if k == 0:
        out.fill(0)
        return out
    policy = precision.compute() if a.dtype == np.float32 else "f32"
    if policy == "bf16":  # the operands as bfloat16 words, read by the tensor cores
        a, b = _bf16(a), _bf16(b)
    a = a if addressable(a) else cupy.ascontiguousarray(a)
    b = b if addressable(b) else cupy.ascontiguousarray(b)
    c = out if writable(out) else cupy.empty(shape, out.dtype)
    h = _handle()
    one, zero = h.one[c.dtype].ctypes.data, h.zero[c.dtype].ctypes.data
    for g in plan(a, b, c):
        pa, pb, pc = (
            x.data.ptr + off * x.itemsize for x, off in ((a, g.a_off), (b, g.b_off), (c, g.c_off))
        )
        if policy == "f32":
            _gemm(h, c.dtype, g, one, zero, pa, pb, pc)
        else:
            _gemm_ex(h, _TYPES[policy], g, one, zero, pa, pb, pc)
    if c is not out:
        out[...] = c
    return out


# cudaDataType_t and cublasComputeType_t: (operands' type, compute type) per reduced precision;
# the result is float32 (CUDA_R_32F) in both.
_R_32F, _R_16BF = 0, 14
_TYPES = {"tf32": (_R_32F, 77), "bf16": (_R_16BF, 68)}  # COMPUTE_32F_FAST_TF32, COMPUTE_32F


def _gemm(h: _Handle, dtype, g, one: int, zero: int, pa: int, pb: int, pc: int) -> None:
    cb = h.cublas
    if g.batch == 1:
        fn = cb.sgemm if dtype == np.float32 else cb.dgemm
        fn(h.ptr, g.op_b, g.op_a, g.n, g.m, g.k, one, pb, g.ldb, pa, g.lda, zero, pc, g.ldc)
        return
    fn = cb.sgemm_strided_batched if dtype == np.float32 else cb.dgemm_strided_batched
    fn(
        h.ptr, g.op_b, g.op_a, g.n, g.m, g.k, one,
        pb, g.ldb, g.b_stride, pa, g.lda, g.a_stride,
        zero, pc, g.ldc, g.c_stride, g.batch,
    )  # fmt: skip


def _gemm_ex(h: _Handle, types, g, one: int, zero: int, pa: int, pb: int, pc: int) -> None:
    """A product of reduced-precision operands summed in float32 (cublasGemmEx), float32
    result; host-pointer scalars are float32 for a 32F compute type."""
    cb, (ab, compute) = h.cublas, types
    algo = -1  # CUBLAS_GEMM_DEFAULT
    if g.batch == 1:
        cb.gemm_ex(
            h.ptr, g.op_b, g.op_a, g.n, g.m, g.k, one,
            pb, ab, g.ldb, pa, ab, g.lda, zero, pc, _R_32F, g.ldc, compute, algo,
        )  # fmt: skip
        return
    cb.gemm_strided_batched_ex(
        h.ptr, g.op_b, g.op_a, g.n, g.m, g.k, one,
        pb, ab, g.ldb, g.b_stride, pa, ab, g.lda, g.a_stride,
        zero, pc, _R_32F, g.ldc, g.c_stride, g.batch, compute, algo,
    )  # fmt: skip


def _bf16(x: cupy.ndarray) -> cupy.ndarray:
    """``x`` (float32) as bfloat16 words, rounded to nearest even: a weight's copy (the view of
    it that matches ``x``, :func:`precision.copy_of`) where it has one, else cast here into a new
    array laid out as the copy's view would be: a transposed weight (Fortran order) as the
    transpose of its cast, anything else C-contiguous. cuBLAS promises the same bits only for
    the same call (shapes, transpositions, leading dimensions) on the same GPU and library, so
    a product reads a weight's copy and a cast of it with one call."""
    words = precision.copy_of(x)
    if words is not None:
        return words
    if x.ndim == 2 and x.flags.f_contiguous and not x.flags.c_contiguous:
        return _bf16(x.T).T
    return precision.words_of(x)
