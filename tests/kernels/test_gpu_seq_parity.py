"""CPU/GPU parity of the sequence ops: every op of ``kernels/gpu_seq.py`` against its NumPy
reference in ``kernels/cpu_seq.py``, in both float dtypes, run twice for the same bits; and the
sequence layers on CuPy against the same layers on NumPy."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from test_gpu_parity import DTYPES, _assert_matches, _bits, _rand

from raysinga import kernels
from raysinga.kernels import cpu_seq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not kernels.gpu_available(),
        reason=f"no usable GPU: {kernels.gpu_unavailable_reason()}",
    ),
]


@pytest.fixture(scope="module")
def gpu_seq():
    from raysinga.kernels import gpu_seq  # noqa: PLC0415 - imports CuPy

    return gpu_seq


def check_op(gpu_seq, name: str, *args) -> None:
    want = getattr(cpu_seq, name)(*args)
    cp = kernels.cupy_module()
    dev_args = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    first, second = (getattr(gpu_seq, name)(*dev_args) for _ in range(2))
    if not isinstance(want, tuple):
        want, first, second = (want,), (first,), (second,)
    for w, a, b in zip(want, first, second, strict=True):
        assert _bits(a) == _bits(b), f"{name} is not deterministic"
        _assert_matches(a, np.asarray(w), exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,v,d", [(1, 1, 1), (7, 5, 3), (4096, 98, 128), (300, 3, 513)])
def test_embedding(gpu_seq, m, v, d, dtype):
    rng = np.random.default_rng(0)
    idx = rng.integers(0, v, m)
    check_op(gpu_seq, "embedding_forward", idx, _rand(rng, (v, d), dtype))
    check_op(gpu_seq, "embedding_backward", idx, _rand(rng, (m, d), dtype), v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,f", [(1, 1), (3, 7), (4096, 128), (5, 700)])
def test_layernorm(gpu_seq, m, f, dtype):
    rng = np.random.default_rng(1)
    x, g, b = _rand(rng, (m, f), dtype, 3.0), _rand(rng, f, dtype), _rand(rng, f, dtype)
    _, mean, rstd = cpu_seq.layernorm_forward(x, g, b, 1e-5)
    check_op(gpu_seq, "layernorm_forward", x, g, b, 1e-5)
    check_op(gpu_seq, "layernorm_backward", _rand(rng, (m, f), dtype), x, g, mean, rstd)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,f", [(1, 1), (3, 7), (4096, 128), (5, 700)])
def test_rmsnorm(gpu_seq, m, f, dtype):
    rng = np.random.default_rng(1)
    x, g = _rand(rng, (m, f), dtype, 3.0), _rand(rng, f, dtype)
    _, rstd = cpu_seq.rmsnorm_forward(x, g, 1e-6)
    check_op(gpu_seq, "rmsnorm_forward", x, g, 1e-6)
    check_op(gpu_seq, "rmsnorm_backward", _rand(rng, (m, f), dtype), x, g, rstd)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7, 13), (64, 512)])
def test_gelu(gpu_seq, shape, dtype):
    rng = np.random.default_rng(2)
    x = _rand(rng, shape, dtype, 3.0)
    _, t = cpu_seq.gelu_forward(x)
    check_op(gpu_seq, "gelu_forward", x)
    check_op(gpu_seq, "gelu_backward", _rand(rng, shape, dtype), x, t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,t", [(1, 1), (3, 5), (128, 128), (2, 300)])
def test_causal_softmax(gpu_seq, b, t, dtype):
    rng = np.random.default_rng(3)
    s = _rand(rng, (b, t, t), dtype, 4.0)
    p = cpu_seq.causal_softmax_forward(s, 0.25)
    check_op(gpu_seq, "causal_softmax_forward", s, 0.25)
    check_op(gpu_seq, "causal_softmax_backward", _rand(rng, (b, t, t), dtype), p, 0.25)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,u", [(1, 1), (5, 7), (64, 256)])
def test_recurrent_cells(gpu_seq, n, u, dtype):
    rng = np.random.default_rng(4)
    gx, gh = _rand(rng, (n, 3 * u), dtype), _rand(rng, (n, 3 * u), dtype)
    h = _rand(rng, (n, u), dtype)
    _, gates = cpu_seq.gru_cell_forward(gx, gh, h)
    check_op(gpu_seq, "gru_cell_forward", gx, gh, h)
    check_op(gpu_seq, "gru_cell_backward", _rand(rng, (n, u), dtype), gates, h)
    g, c = _rand(rng, (n, 4 * u), dtype), _rand(rng, (n, u), dtype)
    _, c_new, acts = cpu_seq.lstm_cell_forward(g, c)
    check_op(gpu_seq, "lstm_cell_forward", g, c)
    dh, dc = _rand(rng, (n, u), dtype), _rand(rng, (n, u), dtype)
    check_op(gpu_seq, "lstm_cell_backward", dh, dc, acts, c, c_new)


def test_every_sequence_op_has_a_gpu_twin(gpu_seq):
    for name in kernels.SEQ_OPS:
        want = inspect.signature(getattr(cpu_seq, name)).parameters
        assert list(inspect.signature(getattr(gpu_seq, name)).parameters) == list(want), name


@pytest.mark.parametrize("kind,opts,in_shape", [
    ("attention", {"heads": 4}, (128, 128)),
    ("gru", {"units": 64}, (16, 32)),
    ("lstm", {"units": 64}, (16, 32)),
    ("layernorm", {}, (16, 32)),
    ("rmsnorm", {}, (16, 32)),
    ("positional", {}, (16, 32)),
])  # fmt: skip
def test_sequence_layers_on_the_gpu_match_numpy(kind, opts, in_shape):
    from raysinga.nn.kinds import LAYERS  # noqa: PLC0415
    from raysinga.nn.layers import StepContext  # noqa: PLC0415

    cp = kernels.cupy_module()
    rng = np.random.default_rng(5)
    layer = LAYERS[kind]("L", **opts)
    out_shape = layer.build(in_shape)
    params = {k: rng.normal(size=s) * 0.3 for k, s in layer.param_shapes().items()}
    x, r = rng.normal(size=(4, *in_shape)), rng.normal(size=(4, *out_shape))
    ctx = StepContext(train=True)
    want = layer.forward(params, {}, x, ctx), *layer.backward(r.copy())
    dev = {k: cp.asarray(v) for k, v in params.items()}
    got = layer.forward(dev, {}, cp.asarray(x), ctx), *layer.backward(cp.asarray(r))
    np.testing.assert_allclose(kernels.to_numpy(got[0]), want[0], rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(kernels.to_numpy(got[1]), want[1], rtol=1e-9, atol=1e-11)
    for k in params:
        np.testing.assert_allclose(kernels.to_numpy(got[2][k]), want[2][k], rtol=1e-9, atol=1e-10)
