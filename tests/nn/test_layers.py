"""Every layer's and loss's backward pass against central finite differences, in float64."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from raysinga.nn.kinds import LAYERS
from raysinga.nn.layers import StepContext
from raysinga.nn.losses import mean_squared_error, softmax_cross_entropy

EPS = 1e-6
TOL = 1e-6


def numeric_grad(f, a: np.ndarray) -> np.ndarray:
    g = np.zeros_like(a)
    flat, gflat = a.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + EPS
        fp = f()
        flat[i] = old - EPS
        fm = f()
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * EPS)
    return g


def assert_close(analytic: np.ndarray, numeric: np.ndarray, what: str) -> None:
    scale = max(float(np.abs(numeric).max(initial=0.0)), 1e-8)
    err = float(np.abs(analytic - numeric).max(initial=0.0)) / scale
    assert err <= TOL, f"{what}: relative error {err:.2e} > {TOL:.0e}"


CASES = [
    # (kind, options, per-sample input shape)
    ("dense", {"units": 5, "activation": "linear"}, (7,)),
    ("dense", {"units": 3, "activation": "relu"}, (4,)),
    ("dense", {"units": 6, "activation": "sigmoid"}, (3,)),
    ("dense", {"units": 1, "activation": "tanh"}, (5,)),
    ("conv2d", {"filters": 3, "kernel": 3, "padding": 1, "activation": "relu"}, (2, 5, 5)),
    ("conv2d", {"filters": 2, "kernel": 2, "stride": 2, "activation": "tanh"}, (3, 7, 6)),
    ("conv2d", {"filters": 4, "kernel": 3, "stride": 2, "padding": 1}, (1, 6, 7)),
    ("conv2d", {"filters": 1, "kernel": 1, "activation": "sigmoid"}, (3, 3, 3)),
    ("maxpool", {"kernel": 2}, (2, 6, 6)),
    ("maxpool", {"kernel": 3, "stride": 2, "padding": 1}, (3, 7, 5)),
    ("maxpool", {"kernel": 2, "stride": 1}, (1, 5, 4)),
    ("avgpool", {"kernel": 2}, (2, 4, 6)),
    ("avgpool", {"kernel": 3, "stride": 2, "padding": 1}, (3, 5, 7)),
    ("relu", {}, (9,)),
    ("sigmoid", {}, (2, 3, 3)),
    ("tanh", {}, (7,)),
    ("flatten", {}, (2, 3, 5)),
    ("dropout", {"rate": 0.4}, (11,)),
    ("dropout", {"rate": 0.5}, (2, 3, 3)),
    ("batchnorm", {}, (5,)),
    ("batchnorm", {"eps": 1e-3}, (3, 4, 5)),
]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kind,opts,in_shape", CASES, ids=lambda v: str(v))
def test_layer_gradients_match_finite_differences(kind, opts, in_shape, batch):
    if kind == "batchnorm" and batch == 1 and len(in_shape) == 1:
        # one sample has zero variance (undefined); two normalise to exactly -1 and +1, a flat
        # function whose gradient is rounding noise
        batch = 3
    rng = np.random.default_rng(zlib.crc32(repr((kind, opts, in_shape, batch)).encode()))
    layer = LAYERS[kind]("L", **opts)
    out_shape = layer.build(in_shape)
    params = {k: rng.normal(size=s) for k, s in layer.param_shapes().items()}
    state = {layer.key(k): np.ones(s) for k, s in layer.state_shapes().items()}
    x = rng.normal(size=(batch, *in_shape))
    r = rng.normal(size=(batch, *out_shape))
    ctx = StepContext(train=True, seed=3, step=5, sample_offset=2)

    def f() -> float:
        return float((layer.forward(params, state, x, ctx) * r).sum())

    f()
    dx, grads = layer.backward(r.copy())
    assert dx.shape == x.shape
    assert set(grads) == set(params)
    assert_close(dx, numeric_grad(f, x), f"{kind} dx")
    for k, p in params.items():
        assert grads[k].shape == p.shape
        assert_close(grads[k], numeric_grad(f, p), f"{kind} d{k}")


@pytest.mark.parametrize("batch,classes", [(1, 2), (4, 10), (7, 3)])
def test_softmax_cross_entropy_gradient(batch, classes):
    rng = np.random.default_rng(batch * 100 + classes)
    z = rng.normal(size=(batch, classes)) * 3
    y = rng.integers(0, classes, size=batch)
    denom = batch + 2
    _, dz = softmax_cross_entropy(z, y, denom)
    assert_close(dz, numeric_grad(lambda: float(softmax_cross_entropy(z, y, denom)[0]), z), "xent")


def test_softmax_cross_entropy_value_and_stability():
    z = np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]])
    loss, _ = softmax_cross_entropy(z, np.array([0, 2]), 2)
    assert np.isfinite(loss)
    np.testing.assert_allclose(float(loss), np.log(3) / 2, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_fused_loss_and_gradient_are_the_bits_of_the_forward_then_the_backward(dtype):
    """``kernels.softmax_xent``, what the loss layers call, against the two ops it replaces."""
    from raysinga.kernels import softmax_xent, softmax_xent_backward, softmax_xent_forward

    rng = np.random.default_rng(3)
    z = (rng.normal(size=(33, 17)) * 4).astype(dtype)
    y = rng.integers(0, 17, size=33)
    loss, dz = softmax_xent(z, y, 7.0)
    want_loss, probs = softmax_xent_forward(z, y, 7.0)
    assert loss.tobytes() == want_loss.tobytes() and dz.dtype == dtype
    assert dz.tobytes() == softmax_xent_backward(probs, y, 7.0).tobytes()


@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (2, 7)])
def test_mse_gradient(shape):
    rng = np.random.default_rng(shape[0] * 10 + shape[1])
    p, t = rng.normal(size=shape), rng.normal(size=shape)
    _, dp = mean_squared_error(p, t, shape[0])
    assert_close(dp, numeric_grad(lambda: float(mean_squared_error(p, t, shape[0])[0]), p), "mse")
    np.testing.assert_allclose(float(mean_squared_error(p, t, shape[0])[0]), ((p - t) ** 2).mean())


def test_labels_out_of_range_are_refused():
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        softmax_cross_entropy(np.zeros((2, 3)), np.array([0, 3]), 2)


def test_unknown_option_and_bad_shape_are_named():
    with pytest.raises(ValueError, match=r"'fc'.*unknown option.*'unit'"):
        LAYERS["dense"]("fc", unit=3)
    with pytest.raises(ValueError, match="add a flatten"):
        LAYERS["dense"]("fc", units=3).build((1, 8, 8))
    with pytest.raises(ValueError, match="does not fit"):
        LAYERS["conv2d"]("c", filters=2, kernel=5).build((1, 3, 3))


def test_dropout_is_identity_at_inference_and_depends_on_global_sample():
    layer = LAYERS["dropout"]("drop", rate=0.5)
    layer.build((50,))
    x = np.ones((4, 50))
    assert layer.forward({}, {}, x, StepContext(train=False)) is x
    whole = layer.forward({}, {}, x, StepContext(True, seed=1, step=7))
    # The second half of the batch computed alone, as another worker would, gives the same mask.
    half = layer.forward({}, {}, x[2:], StepContext(True, seed=1, step=7, sample_offset=2))
    np.testing.assert_array_equal(whole[2:], half)
    other_step = layer.forward({}, {}, x, StepContext(True, seed=1, step=8))
    assert not np.array_equal(whole, other_step)
    assert set(np.unique(whole)) == {0.0, 2.0}


def test_a_layers_random_stream_is_the_samples_wherever_they_are_computed():
    """``Layer.uniform``: the draws of a batch are those of its samples by their global index,
    so two workers that split the batch draw what one worker draws; another step, another
    layer or another seed draws others."""
    from raysinga.nn.layers import Layer, StepContext

    like = np.zeros((6, 3, 2), np.float32)
    a, b = Layer("noise"), Layer("other")
    one = a.uniform(StepContext(train=True, seed=3, step=7), like)
    split = np.concatenate(
        [
            a.uniform(StepContext(train=True, seed=3, step=7, sample_offset=0), like[:2]),
            a.uniform(StepContext(train=True, seed=3, step=7, sample_offset=2), like[2:]),
        ]
    )
    assert one.dtype == np.float32 and one.shape == like.shape
    assert one.tobytes() == split.tobytes()
    assert 0.0 <= one.min() and one.max() < 1.0 and 0.3 < one.mean() < 0.7
    for other in (
        a.uniform(StepContext(train=True, seed=3, step=8), like),
        b.uniform(StepContext(train=True, seed=3, step=7), like),
        a.uniform(StepContext(train=True, seed=4, step=7), like),
    ):
        assert not np.array_equal(one, other)
    # the same bits as dropout's mask: an element is kept where its draw is at least the rate
    from raysinga import kernels as K

    mask = K.dropout_mask(like, 0.5, K.dropout_key(3, 7, "noise"), 0)
    assert np.array_equal(mask > 0, one >= 0.5)
