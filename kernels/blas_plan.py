"""How a matrix product of strided views becomes cuBLAS calls, for ``gpu_blas``.

Pure arithmetic on shapes and strides (NumPy's or CuPy's arrays alike), kept apart from the
module that calls cuBLAS so that the CPU suite checks it: a test runs the plans below through a
NumPy model of column-major gemm and compares with ``numpy.matmul``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

N, T = 0, 1  # cublasOperation_t


def binding_error() -> str | None:
    """Why NVIDIA's cuBLAS bindings (nvmath-python) cannot be used here, or None. Imports
    neither CuPy nor a CUDA library beyond the bindings' module."""
    try:
        from nvmath.bindings import cublas  # noqa: F401, PLC0415 - optional dependency
    except Exception as e:  # ImportError, or a wheel that fails to load its libraries
        return f"nvmath-python's cuBLAS bindings cannot be imported ({type(e).__name__}: {e})"
    return None


@dataclass(frozen=True)
class Gemm:
    """One cuBLAS call of a product: column-major ``C^T = op(B) op(A)`` (row-major ``C = A B``),
    ``batch`` matrices apart by the given element strides (one plain gemm where ``batch`` is 1).
    Offsets are in elements from each operand's first one."""

    op_b: int
    op_a: int
    n: int
    m: int
    k: int
    b_off: int
    ldb: int
    b_stride: int
    a_off: int
    lda: int
    a_stride: int
    c_off: int
    ldc: int
    c_stride: int
    batch: int


def addressable(x) -> tuple[int, int] | None:
    """``(op, ld)`` of a row-major matrix view ``x`` (its last two axes) as cuBLAS reads it, or
    None where it cannot. cuBLAS is column-major: a matrix whose rows are contiguous is read as
    its transpose with op N, one whose columns are (a transposed view) with op T."""
    item = x.itemsize
    r, c = x.shape[-2:]
    s_r, s_c = x.strides[-2:]
    if s_r % item or s_c % item:
        return None
    if (s_c == item or c == 1) and (r == 1 or s_r // item >= c):
        return N, max(s_r // item if r > 1 else c, c, 1)
    if (s_r == item or r == 1) and (c == 1 or s_c // item >= r):
        return T, max(s_c // item if c > 1 else r, r, 1)
    return None


def writable(c) -> bool:
    """Whether cuBLAS can write the row-major matrix view ``c`` in place (rows contiguous)."""
    item = c.itemsize
    m, n = c.shape[-2:]
    s_r, s_c = c.strides[-2:]
    if s_r % item or s_c % item:
        return False
    return (s_c == item or n == 1) and (m == 1 or s_r // item >= n)


def _batch_strides(x, batch: tuple[int, ...]) -> list[int]:
    """Element strides of ``x`` over the broadcast ``batch`` axes (0 where it is broadcast)."""
    lead = x.ndim - 2
    out = []
    for i in range(len(batch)):
        j = i - (len(batch) - lead)
        out.append(0 if j < 0 or x.shape[j] == 1 else x.strides[j] // x.itemsize)
    return out


def _collapse(batch: tuple[int, ...], strides: list[list[int]]) -> tuple[list[int], list[list]]:
    """Batch axes merged where every operand steps through them evenly: ``(sizes, strides)``,
    outermost first."""
    sizes: list[int] = []
    merged: list[list[int]] = [[] for _ in strides]
    for i, size in enumerate(batch):
        if size == 1:
            continue
        if sizes and all(m[-1] == s[i] * size for m, s in zip(merged, strides, strict=True)):
            sizes[-1] *= size
            for m, s in zip(merged, strides, strict=True):
                m[-1] = s[i]
            continue
        sizes.append(size)
        for m, s in zip(merged, strides, strict=True):
            m.append(s[i])
    return sizes, merged


def plan(a, b, c) -> list[Gemm]:
    """The calls that compute ``c[...] = a @ b`` for views cuBLAS can address (``addressable``
    operands, a ``writable`` result of the broadcast shape): one strided-batched call over the
    innermost batch axis that every operand steps through evenly, once per index of the outer
    ones. Works on NumPy arrays as on CuPy's (only shapes and strides are read), so the plan is
    tested on the CPU."""
    (op_a, lda), (op_b, ldb) = addressable(a), addressable(b)
    m, k = a.shape[-2:]
    n = b.shape[-1]
    ldc = max(c.strides[-2] // c.itemsize if m > 1 else n, n, 1)
    batch = tuple(c.shape[:-2])
    sizes, (sa, sb, sc) = _collapse(batch, [_batch_strides(x, batch) for x in (a, b, c)])
    inner = sizes[-1] if sizes else 1
    ia, ib, ic = (s[-1] if s else 0 for s in (sa, sb, sc))
    calls = []
    for index in np.ndindex(*sizes[:-1]):
        offs = [sum(i * st for i, st in zip(index, s, strict=False)) for s in (sa, sb, sc)]
        calls.append(
            Gemm(op_b, op_a, n, m, k, offs[1], ldb, ib, offs[0], lda, ia, offs[2], ldc, ic, inner)
        )
    return calls
