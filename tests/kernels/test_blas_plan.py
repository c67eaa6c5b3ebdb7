"""The plans ``gpu_blas.matmul`` hands to cuBLAS, run through a NumPy model of column-major
(strided-batched) gemm on the operands' own memory, against ``numpy.matmul``: transposed and
strided views, broadcast batches, and the attention layer's head views."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from raysinga.kernels.blas_plan import N, addressable, plan, writable


def _colmajor(buf: np.ndarray, off: int, op: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """op(X) of the column-major matrix X stored at ``buf[off:]`` with leading dimension
    ``ld``; ``rows x cols`` is op(X)'s shape, as cuBLAS's m, n, k describe it."""
    item = buf.itemsize
    stored = (rows, cols) if op == N else (cols, rows)
    x = as_strided(buf[off:], shape=stored, strides=(item, ld * item))
    return x if op == N else x.T


def _run(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    """Execute plan(a, b, c) with the model: C^T (n x m) = op(B) (n x k) op(A) (k x m)."""
    for g in plan(a, b, c):
        for i in range(g.batch):
            ma = _colmajor(_base(a), _start(a) + g.a_off + i * g.a_stride, g.op_a, g.k, g.m, g.lda)
            mb = _colmajor(_base(b), _start(b) + g.b_off + i * g.b_stride, g.op_b, g.n, g.k, g.ldb)
            mc = _colmajor(_base(c), _start(c) + g.c_off + i * g.c_stride, N, g.n, g.m, g.ldc)
            mc[...] = mb @ ma


def _base(x: np.ndarray) -> np.ndarray:
    while x.base is not None:
        x = x.base
    return x.reshape(-1)


def _start(x: np.ndarray) -> int:
    return (x.ctypes.data - _base(x).ctypes.data) // x.itemsize


def _check(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> None:
    want = np.matmul(a, b)
    if out is None:
        out = np.full(want.shape, np.nan, a.dtype)
    assert addressable(a) and addressable(b) and writable(out)
    _run(a, b, out)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_plain_and_transposed_matrices(rng):
    x, w = rng.normal(size=(5, 3)), rng.normal(size=(3, 4))
    _check(x, w)
    _check(rng.normal(size=(3, 5)).T, w)  # x.T @ dz, as a dense layer's dw
    _check(x, rng.normal(size=(4, 3)).T)  # dz @ w.T
    _check(rng.normal(size=(3, 5)).T, rng.normal(size=(4, 3)).T)


def test_row_strided_views_and_single_rows_and_columns(rng):
    seq = rng.normal(size=(6, 7, 3))  # dgh[:, step] @ wh: rows 21 elements apart
    _check(seq[:, 2], rng.normal(size=(3, 4)))
    _check(rng.normal(size=(1, 3)), rng.normal(size=(3, 4)))
    _check(rng.normal(size=(5, 3)), rng.normal(size=(3, 1)))
    _check(rng.normal(size=(1, 1)), rng.normal(size=(1, 1)))


def test_batches_broadcast_and_collapsed(rng):
    _check(rng.normal(size=(2, 3, 5, 4)), rng.normal(size=(4, 6)))  # b broadcast: stride 0
    _check(rng.normal(size=(2, 3, 5, 4)), rng.normal(size=(2, 3, 4, 6)))
    _check(rng.normal(size=(3, 5, 4)), rng.normal(size=(2, 1, 4, 6)))
    plans = plan(np.zeros((2, 3, 5, 4)), np.zeros((2, 3, 4, 6)), np.zeros((2, 3, 5, 6)))
    assert len(plans) == 1 and plans[0].batch == 6  # contiguous batches: one call


def test_the_attention_layers_head_views(rng):
    n, t, h, hd = 2, 5, 3, 4
    proj = rng.normal(size=(n, t, 3, h, hd))
    q, k, v = (proj[:, :, j].transpose(0, 2, 1, 3) for j in range(3))
    _check(q, k.transpose(0, 1, 3, 2))  # scores
    probs = rng.normal(size=(n, h, t, t))
    merged = np.full((n, t, h, hd), np.nan)
    _check(probs, v, merged.transpose(0, 2, 1, 3))  # written straight into the merged layout
    _check(probs.transpose(0, 1, 3, 2), rng.normal(size=(n, h, t, hd)))


def test_views_cublas_cannot_address_are_refused_so_matmul_copies_them(rng):
    x = rng.normal(size=(6, 8))
    assert addressable(x[:, ::2]) is None  # neither rows nor columns contiguous
    assert addressable(x[::-1]) is None
    assert not writable(np.zeros((4, 3)).T)
