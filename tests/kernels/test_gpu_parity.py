"""CPU/GPU parity: every op of ``kernels/gpu.py`` against its NumPy reference in ``kernels/cpu.py``.

Each op gets one shared test over shapes (batch 1, odd sizes) and both float dtypes. Floats agree to
1e-5 (float32) or 1e-12 (float64) of the reference's largest magnitude; integer outputs and dropout
masks agree exactly; and every GPU op, run twice, gives the same bits (no atomics anywhere).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from raysinga import kernels
from raysinga.kernels import common, cpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not kernels.gpu_available(),
        reason=f"no usable GPU: {kernels.gpu_unavailable_reason()}",
    ),
]

DTYPES = [np.float32, np.float64]
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}
ACTS = list(common.ACTIVATIONS)


@pytest.fixture(scope="module")
def gpu():
    from raysinga.kernels import gpu  # noqa: PLC0415 - imports CuPy, only where a GPU is usable

    return gpu


def _rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _assert_matches(got, want, exact: bool) -> None:
    got = kernels.to_numpy(got)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.dtype)
    if exact or want.dtype.kind in "iub":
        np.testing.assert_array_equal(got, want)
        return
    scale = float(np.abs(want).max(initial=0.0)) or 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[want.dtype] * scale)


def _bits(a) -> bytes:
    return kernels.to_numpy(a).tobytes()


def check_op(gpu, name: str, *args, exact: bool = False) -> None:
    """Run ``name`` on NumPy and on CuPy (twice): same results, and the same bits on both runs."""
    want = getattr(cpu, name)(*args)
    cp = kernels.cupy_module()
    dev_args = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    first, second = (getattr(gpu, name)(*dev_args) for _ in range(2))
    if not isinstance(want, tuple):
        want, first, second = (want,), (first,), (second,)
    for w, a, b in zip(want, first, second, strict=True):
        assert isinstance(a, cp.ndarray)
        assert _bits(a) == _bits(b), f"{name} is not deterministic"
        _assert_matches(a, np.asarray(w), exact)


# ---------------------------------------------------------------- activations and dense layers

MATRICES = [(1, 1), (1, 7), (5, 3), (33, 130), (700, 5)]  # 700 rows: a multi-pass column sum


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MATRICES)
@pytest.mark.parametrize("act", ACTS)
def test_activations(gpu, act, shape, dtype):
    rng = np.random.default_rng(0)
    z, dy = _rand(rng, shape, dtype, 3.0), _rand(rng, shape, dtype)
    b = _rand(rng, shape[1:], dtype)
    y = cpu.bias_act_forward(z, b, act)
    check_op(gpu, "activation_forward", z, act)
    check_op(gpu, "activation_backward", dy, y, act)
    check_op(gpu, "bias_act_forward", z, b, act)
    check_op(gpu, "bias_act_backward", dy, y, act)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,fin,fout", [(1, 1, 1), (1, 5, 3), (7, 13, 9), (64, 33, 17)])
@pytest.mark.parametrize("act", ACTS)
def test_dense(gpu, act, n, fin, fout, dtype):
    rng = np.random.default_rng(1)
    x, w, b = _rand(rng, (n, fin), dtype), _rand(rng, (fin, fout), dtype), _rand(rng, fout, dtype)
    y = cpu.dense_forward(x, w, b, act)
    check_op(gpu, "dense_forward", x, w, b, act)
    check_op(gpu, "dense_backward", x, w, y, _rand(rng, y.shape, dtype), act)


# ---------------------------------------------------------------- losses


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,c", [(1, 1), (1, 10), (7, 3), (65, 1000), (300, 7)])
@pytest.mark.parametrize("label_dtype", [np.int32, np.int64])
def test_softmax_xent(gpu, n, c, dtype, label_dtype):
    rng = np.random.default_rng(2)
    logits = _rand(rng, (n, c), dtype, 4.0)
    labels = rng.integers(0, c, n).astype(label_dtype)
    _, probs = cpu.softmax_xent_forward(logits, labels, n)
    check_op(gpu, "softmax_xent_forward", logits, labels, float(n))
    check_op(gpu, "softmax_xent_forward", logits, labels, 2.5)
    check_op(gpu, "softmax_xent_backward", probs, labels, float(n))
    check_op(gpu, "softmax_xent", logits, labels, float(n))
    cp = kernels.cupy_module()
    on_gpu = cp.asarray(logits), cp.asarray(labels)
    loss, d = gpu.softmax_xent(*on_gpu, 2.5)
    loss2, probs2 = gpu.softmax_xent_forward(*on_gpu, 2.5)
    d2 = gpu.softmax_xent_backward(probs2, on_gpu[1], 2.5)
    assert loss.get().tobytes() == loss2.get().tobytes()  # the two kernels' bits, in one
    assert d.get().tobytes() == d2.get().tobytes()


# ---------------------------------------------------------------- convolution

# (n, c, h, w, kh, kw, stride, pad)
CONVS = [
    (1, 1, 1, 1, 1, 1, 1, 0),
    (2, 3, 7, 5, 3, 3, 1, 1),
    (1, 2, 8, 9, 3, 2, 2, 0),
    (3, 1, 6, 6, 5, 5, 3, 2),
    (2, 4, 5, 7, 2, 3, 2, 1),
    (1, 3, 4, 4, 4, 4, 1, 3),  # padding wider than the input overlap
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,c,h,w,kh,kw,stride,pad", CONVS)
def test_im2col_col2im(gpu, n, c, h, w, kh, kw, stride, pad, dtype):
    rng = np.random.default_rng(3)
    x = _rand(rng, (n, c, h, w), dtype)
    cols = cpu.im2col(x, kh, kw, stride, pad)
    check_op(gpu, "im2col", x, kh, kw, stride, pad)
    check_op(gpu, "col2im", _rand(rng, cols.shape, dtype), (n, c, h, w), kh, kw, stride, pad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,c,h,w,kh,kw,stride,pad", CONVS)
@pytest.mark.parametrize("act", ["linear", "relu", "tanh"])
def test_conv2d(gpu, n, c, h, w, kh, kw, stride, pad, act, dtype):
    rng = np.random.default_rng(4)
    x, wt = _rand(rng, (n, c, h, w), dtype), _rand(rng, (5, c, kh, kw), dtype)
    b = _rand(rng, 5, dtype)
    y, cols = cpu.conv2d_forward(x, wt, b, stride, pad, act)
    dy = _rand(rng, y.shape, dtype)
    check_op(gpu, "conv2d_forward", x, wt, b, stride, pad, act)
    check_op(gpu, "conv2d_backward", dy, y, cols, wt, x.shape, stride, pad, act)


# ---------------------------------------------------------------- pooling

# (n, c, h, w, k, stride, pad); pooling needs 2 * pad <= k.
POOLS = [
    (1, 1, 1, 1, 1, 1, 0),
    (2, 3, 8, 8, 2, 2, 0),
    (1, 2, 7, 5, 3, 1, 1),
    (3, 1, 9, 6, 3, 2, 1),
    (2, 2, 5, 5, 2, 1, 1),
    (1, 3, 10, 7, 4, 3, 2),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,c,h,w,k,stride,pad", POOLS)
def test_maxpool(gpu, n, c, h, w, k, stride, pad, dtype):
    rng = np.random.default_rng(5)
    # Small integers: windows hold ties, so "the first maximum wins" is exercised.
    x = rng.integers(-3, 4, (n, c, h, w)).astype(dtype)
    y, arg = cpu.maxpool_forward(x, k, stride, pad)
    check_op(gpu, "maxpool_forward", x, k, stride, pad)
    dy = _rand(rng, y.shape, dtype)
    check_op(gpu, "maxpool_backward", dy, arg, x.shape, k, stride, pad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,c,h,w,k,stride,pad", POOLS)
def test_avgpool(gpu, n, c, h, w, k, stride, pad, dtype):
    rng = np.random.default_rng(6)
    x = _rand(rng, (n, c, h, w), dtype)
    y = cpu.avgpool_forward(x, k, stride, pad)
    check_op(gpu, "avgpool_forward", x, k, stride, pad)
    check_op(gpu, "avgpool_backward", _rand(rng, y.shape, dtype), x.shape, k, stride, pad)


# ---------------------------------------------------------------- dropout


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (4, 3, 5, 5), (0, 4)])
@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("sample_offset", [0, 12345])
def test_dropout_mask(gpu, shape, rate, sample_offset, dtype):
    x = np.zeros(shape, dtype)
    key = common.dropout_key(7, 3, "fc1")
    check_op(gpu, "dropout_mask", x, rate, key, sample_offset, exact=True)


# ---------------------------------------------------------------- batch normalisation


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 3), (7, 5), (600, 2), (1, 2, 3, 3), (2, 3, 4, 5), (8, 8, 9, 9)]
)
def test_batchnorm(gpu, shape, dtype):
    rng = np.random.default_rng(7)
    x = _rand(rng, shape, dtype, 2.0) + 0.5
    gamma, beta = _rand(rng, shape[1], dtype), _rand(rng, shape[1], dtype)
    _, mean, var, inv_std = cpu.batchnorm_forward_train(x, gamma, beta, 1e-5)
    check_op(gpu, "batchnorm_forward_train", x, gamma, beta, 1e-5)
    check_op(gpu, "batchnorm_forward_infer", x, gamma, beta, mean, var, 1e-5)
    check_op(gpu, "batchnorm_backward", _rand(rng, shape, dtype), x, gamma, mean, inv_std)


# ---------------------------------------------------------------- every op is covered


def _params(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_op_has_a_gpu_twin(gpu):
    for name in kernels.OPS:
        assert _params(getattr(gpu, name)) == _params(getattr(cpu, name)), name


def test_reductions_are_deterministic_at_scale(gpu):
    """Big reductions, where atomics or a launch-dependent order would show, give the same bits."""
    cp = kernels.cupy_module()
    rng = np.random.default_rng(8)
    dy, y = (cp.asarray(_rand(rng, (20000, 3), np.float32)) for _ in range(2))
    logits = cp.asarray(_rand(rng, (257, 3001), np.float32))
    labels = cp.asarray(rng.integers(0, 3001, 257))
    x = cp.asarray(_rand(rng, (8, 4, 33, 33), np.float32))
    g, b = cp.ones(4, np.float32), cp.zeros(4, np.float32)
    runs = [
        lambda: gpu.bias_act_backward(dy, y, "sigmoid"),
        lambda: gpu.softmax_xent_forward(logits, labels, 257.0),
        lambda: gpu.batchnorm_forward_train(x, g, b, 1e-5),
        lambda: gpu.batchnorm_backward(x, x, g, x.mean(axis=(0, 2, 3)), g),
    ]
    for run in runs:
        for a, b2 in zip(run(), run(), strict=True):
            assert _bits(a) == _bits(b2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 2, 5])
def test_weighted_sum_is_the_stubs_sum_bit_for_bit(dtype, k):
    """The stub's sum of its workers' gradients in one pass: the same bits as NumPy's adds in
    worker order, and as NumPy's multiply-then-add with weights."""
    import cupy  # noqa: PLC0415

    from raysinga.kernels.gpu_optim import weighted_sum  # noqa: PLC0415

    rng = np.random.default_rng(k)
    n = 3 * 256 + 7
    host = [_rand(rng, (n,), dtype) for _ in range(k)]
    want = host[0].copy()
    for g in host[1:]:
        np.add(want, g, out=want)
    bufs = [cupy.asarray(g) for g in host]
    out = cupy.empty(n, dtype)
    _assert_matches(weighted_sum(out, bufs), want, exact=True)
    w = rng.random(k).astype(dtype)
    want_w = w[0] * host[0]
    for j in range(1, k):
        want_w = want_w + w[j] * host[j]
    got = kernels.to_numpy(weighted_sum(out, bufs, cupy.asarray(w)))
    _assert_matches(got, want_w, exact=True)
    again = kernels.to_numpy(weighted_sum(cupy.empty(n, dtype), bufs, cupy.asarray(w)))
    assert again.tobytes() == got.tobytes()
    with pytest.raises(ValueError, match="does not match out"):
        weighted_sum(out, [*bufs, cupy.empty(n + 1, dtype)])
    with pytest.raises(ValueError, match="at least one buffer"):
        weighted_sum(out, [])
