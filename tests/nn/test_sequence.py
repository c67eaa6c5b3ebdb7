"""The sequence layers: backward passes against central finite differences in float64, and
forward and backward against the matching PyTorch modules (weights moved by transposing)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_layers import assert_close, numeric_grad

from raysinga.nn.kinds import LAYERS
from raysinga.nn.layers import StepContext
from raysinga.nn.losses import sequence_cross_entropy
from raysinga.nn.model import ModelSpec, Net

CTX = StepContext(train=True, seed=1, step=2)

CASES = [
    # (kind, options, per-sample input shape)
    ("layernorm", {}, (6,)),
    ("layernorm", {"eps": 1e-3}, (3, 5)),
    ("rmsnorm", {}, (6,)),
    ("rmsnorm", {"eps": 1e-3}, (3, 5)),
    ("gelu", {}, (4, 3)),
    ("add", {}, (2, 3)),
    ("positional", {}, (3, 2)),
    ("attention", {"heads": 1}, (4, 3)),
    ("attention", {"heads": 2}, (5, 4)),
    ("gru", {"units": 3}, (4, 2)),
    ("lstm", {"units": 3}, (4, 2)),
    ("dense", {"units": 3, "activation": "tanh"}, (4, 2)),  # at every position
]


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kind,opts,in_shape", CASES, ids=lambda v: str(v))
def test_sequence_layer_gradients_match_finite_differences(kind, opts, in_shape, batch):
    rng = _rng(kind, opts, in_shape, batch)
    layer = LAYERS[kind]("L", **opts)
    out_shape = layer.build(in_shape)
    params = {k: rng.normal(size=s) * 0.7 for k, s in layer.param_shapes().items()}
    x = rng.normal(size=(batch, *in_shape))
    r = rng.normal(size=(batch, *out_shape))

    def f() -> float:
        return float((layer.forward(params, {}, x, CTX) * r).sum())

    f()
    dx, grads = layer.backward(r.copy())
    assert dx.shape == x.shape and set(grads) == set(params)
    assert_close(dx, numeric_grad(f, x), f"{kind} dx")
    for k, p in params.items():
        assert grads[k].shape == p.shape
        assert_close(grads[k], numeric_grad(f, p), f"{kind} d{k}")


def test_embedding_gradient_sums_the_rows_that_picked_each_token():
    rng = _rng("embedding")
    layer = LAYERS["embedding"]("E", vocab=5, dim=3)
    layer.build((6,))
    w = rng.normal(size=(5, 3))
    idx = np.array([[0, 2, 2, 4, 0, 0], [1, 1, 2, 3, 4, 4]])
    r = rng.normal(size=(2, 6, 3))

    def f() -> float:
        return float((layer.forward({"W": w}, {}, idx, CTX) * r).sum())

    f()
    dx, grads = layer.backward(r.copy())
    assert dx is None  # token ids have no gradient
    assert_close(grads["W"], numeric_grad(f, w), "embedding dW")
    with pytest.raises(ValueError, match="token index 5 is outside the vocabulary"):
        layer.forward({"W": w}, {}, idx + 1, CTX)
    with pytest.raises(ValueError, match="integer token ids"):
        layer.forward({"W": w}, {}, idx.astype(float), CTX)


@pytest.mark.parametrize("batch,t,v", [(1, 3, 2), (2, 5, 7)])
def test_sequence_cross_entropy_gradient_and_mean_per_token(batch, t, v):
    rng = _rng("seqxent", batch, t, v)
    z = rng.normal(size=(batch, t, v)) * 2
    y = rng.integers(0, v, size=(batch, t))
    loss, dz = sequence_cross_entropy(z, y, batch)
    f = lambda: float(sequence_cross_entropy(z, y, batch)[0])  # noqa: E731
    assert_close(dz, numeric_grad(f, z), "sequence cross-entropy")
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, y[..., None], -1).mean()
    assert abs(float(loss) - want) < 1e-12


# -- residual connections -------------------------------------------------------------------------

BLOCK = {
    "input_shape": [6],
    "loss": "sequence_cross_entropy",
    "layers": [
        {"kind": "embedding", "name": "emb", "vocab": 7, "dim": 4},
        {"kind": "layernorm", "name": "ln1"},
        {"kind": "attention", "name": "attn", "heads": 2},
        {"kind": "add", "name": "res1", "from": ["emb", "attn"]},
        {"kind": "layernorm", "name": "ln2"},
        {"kind": "dense", "name": "up", "units": 8},
        {"kind": "gelu", "name": "act"},
        {"kind": "dense", "name": "down", "units": 4},
        {"kind": "add", "name": "res2", "from": ["res1", "down"]},
        {"kind": "dense", "name": "head", "units": 7},
    ],
}


def test_a_net_with_residual_connections_has_the_gradient_of_its_loss():
    net = Net(ModelSpec.from_dict(BLOCK), "float64")
    params = net.init_params(3)
    rng = _rng("block")
    x = rng.integers(0, 7, size=(2, 6))
    y = rng.integers(0, 7, size=(2, 6))
    _, grads, _ = net.loss_and_grads(params, {}, x, y, CTX)
    for key in ("emb/W", "attn/Wqkv", "ln1/gamma", "up/W"):
        p = params[key]
        f = lambda: net.loss_and_grads(params, {}, x, y, CTX)[0]  # noqa: E731
        assert_close(grads[key], numeric_grad(f, p), key)


@pytest.mark.parametrize(
    "layers, named",
    [
        ([{"kind": "add", "name": "a", "from": ["nope"]}], ["from", "nope", "no earlier layer"]),
        (
            [
                {"kind": "dense", "name": "d", "units": 3},
                {"kind": "add", "name": "a", "from": ["emb", "d"]},
            ],
            ["different shapes"],
        ),
        (
            [
                {"kind": "dense", "name": "d", "units": 4},
                {"kind": "add", "name": "a", "from": ["emb"]},
            ],
            ["layers[1] (d)", "used by no later layer"],
        ),
        ([{"kind": "add", "name": "a", "from": 3}], ["expected a list"]),
    ],
)
def test_bad_residual_connections_are_named(layers, named):
    spec = {
        "input_shape": [6],
        "layers": [{"kind": "embedding", "name": "emb", "vocab": 7, "dim": 4}, *layers],
    }
    with pytest.raises(ValueError) as e:
        ModelSpec.from_dict(spec)
    for n in named:
        assert n in str(e.value)


# -- PyTorch parity -------------------------------------------------------------------------------


def _torch_case(kind: str, opts: dict, in_shape: tuple, rng):
    """The layer, its parameters, and the PyTorch module holding the same weights."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    layer = LAYERS[kind]("L", **opts)
    layer.build(in_shape)
    p = {k: rng.normal(size=s) * 0.5 for k, s in layer.param_shapes().items()}
    t = lambda a: torch.tensor(np.ascontiguousarray(a))  # noqa: E731
    d = in_shape[-1]
    if kind == "layernorm":
        m = nn.LayerNorm(d, eps=layer.opts["eps"], dtype=torch.float64)
        m.weight.data, m.bias.data = t(p["gamma"]), t(p["beta"])
    elif kind == "rmsnorm":
        m = nn.RMSNorm(d, eps=layer.opts["eps"], dtype=torch.float64)
        m.weight.data = t(p["gamma"])
    elif kind == "gelu":
        m = nn.GELU(approximate="tanh")
    elif kind == "embedding":
        m = nn.Embedding(opts["vocab"], opts["dim"], dtype=torch.float64)
        m.weight.data = t(p["W"])
    elif kind == "attention":
        mha = nn.MultiheadAttention(d, opts["heads"], batch_first=True, dtype=torch.float64)
        mha.in_proj_weight.data, mha.in_proj_bias.data = t(p["Wqkv"].T), t(p["bqkv"])
        mha.out_proj.weight.data, mha.out_proj.bias.data = t(p["Wo"].T), t(p["bo"])
        mask = torch.triu(torch.ones(in_shape[0], in_shape[0], dtype=torch.bool), 1)
        m = lambda x: mha(x, x, x, attn_mask=mask, need_weights=False)[0]  # noqa: E731
        m.parameters = mha.parameters
        m.named = {"Wqkv": mha.in_proj_weight, "bqkv": mha.in_proj_bias}
        m.named |= {"Wo": mha.out_proj.weight, "bo": mha.out_proj.bias}
    else:  # gru, lstm
        cls = nn.GRU if kind == "gru" else nn.LSTM
        rnn = cls(d, opts["units"], batch_first=True, dtype=torch.float64)
        rnn.weight_ih_l0.data, rnn.weight_hh_l0.data = t(p["Wx"].T), t(p["Wh"].T)
        rnn.bias_ih_l0.data, rnn.bias_hh_l0.data = t(p["bx"]), t(p["bh"])
        m = lambda x: rnn(x)[0]  # noqa: E731
        m.named = {"Wx": rnn.weight_ih_l0, "Wh": rnn.weight_hh_l0}
        m.named |= {"bx": rnn.bias_ih_l0, "bh": rnn.bias_hh_l0}
    if not hasattr(m, "named"):
        names = {"gamma": "weight", "beta": "bias", "W": "weight"}
        m.named = {k: dict(m.named_parameters())[names[k]] for k in p}
    return layer, p, m


TORCH_CASES = [
    ("layernorm", {}, (5, 6)),
    ("rmsnorm", {}, (5, 6)),
    ("gelu", {}, (5, 6)),
    ("embedding", {"vocab": 9, "dim": 4}, (5,)),
    ("attention", {"heads": 2}, (7, 8)),
    ("attention", {"heads": 4}, (5, 8)),
    ("gru", {"units": 6}, (7, 3)),
    ("lstm", {"units": 6}, (7, 3)),
]


@pytest.mark.parametrize("kind,opts,in_shape", TORCH_CASES, ids=lambda v: str(v))
def test_sequence_layers_match_pytorch(kind, opts, in_shape):
    torch = pytest.importorskip("torch")
    rng = _rng("torch", kind, opts, in_shape)
    layer, p, m = _torch_case(kind, opts, in_shape, rng)
    if kind == "embedding":
        x = rng.integers(0, opts["vocab"], size=(3, *in_shape))
        tx = torch.tensor(x)
    else:
        x = rng.normal(size=(3, *in_shape))
        tx = torch.tensor(x, requires_grad=True)
    y = layer.forward(p, {}, x, CTX)
    ty = m(tx)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    r = rng.normal(size=y.shape)
    dx, grads = layer.backward(r.copy())
    (ty * torch.tensor(r)).sum().backward()
    if kind != "embedding":
        np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-9, atol=1e-11)
    for k, g in grads.items():
        want = m.named[k].grad.numpy()
        want = want.T if want.ndim == 2 and kind in ("attention", "gru", "lstm") else want
        np.testing.assert_allclose(g, want, rtol=1e-9, atol=1e-11, err_msg=k)
