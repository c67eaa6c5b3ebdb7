"""``check_layer`` (raysinga/nn/testing.py): every layer of raysinga's own and the example's
layers of the user's own pass it; a layer with a deliberate error fails it, named."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from raysinga.nn import LAYERS, Layer
from raysinga.nn.testing import LayerCheckError, check_layer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "custom_layers"))
import mylayers  # noqa: E402  (the example's own module, as its job ships it)

# every kind of raysinga's own: its options and one sample's input shape
OWN = {
    "dense": ({"units": 3, "activation": "tanh"}, (4,)),
    "conv2d": ({"filters": 2, "kernel": 3, "padding": 1, "activation": "sigmoid"}, (2, 5, 5)),
    "maxpool": ({"kernel": 2}, (2, 4, 4)),
    "avgpool": ({"kernel": 2, "stride": 1}, (2, 4, 4)),
    "relu": ({}, (6,)),
    "sigmoid": ({}, (6,)),
    "tanh": ({}, (6,)),
    "flatten": ({}, (2, 3, 3)),
    "dropout": ({"rate": 0.5}, (8,)),
    "batchnorm": ({}, (2, 3, 3)),
    "embedding": ({"vocab": 7, "dim": 3}, (5,)),
    "positional": ({}, (5, 3)),
    "layernorm": ({}, (5, 4)),
    "rmsnorm": ({}, (5, 4)),
    "gelu": ({}, (6,)),
    "add": ({}, (4,)),
    "attention": ({"heads": 2}, (4, 6)),
    "gru": ({"units": 3}, (4, 2)),
    "lstm": ({"units": 3}, (4, 2)),
}


def test_every_kind_of_raysingas_own_is_checked_here():
    assert set(OWN) == set(LAYERS)


@pytest.mark.parametrize("kind", sorted(OWN))
def test_raysingas_own_layers_pass(kind):
    opts, shape = OWN[kind]
    worst = check_layer(LAYERS[kind]("l", **opts), shape)
    assert all(v <= 1.0 for v in worst.values())


@pytest.mark.parametrize(
    ("layer", "shape"),
    [
        (mylayers.RMSNorm("n"), (5, 4)),
        (mylayers.SwiGLU("ffn", hidden=6), (3, 4)),
        (mylayers.UserLayerNorm("ln"), (5, 4)),
    ],
    ids=["RMSNorm", "SwiGLU", "UserLayerNorm"],
)
def test_the_examples_layers_pass(layer, shape):
    check_layer(layer, shape)


class BadSwiGLU(mylayers.SwiGLU):
    """The example's SwiGLU with the up projection's gradient off by a factor."""

    def backward(self, dy):
        dx, g = super().backward(dy)
        return dx, {**g, "Wu": g["Wu"] * 1.01}


class Leaky(Layer):
    """Keeps a running count on itself, outside the state arrays."""

    seen = 0

    def forward(self, p, s, x, ctx):
        self.seen += 1
        return x * self.seen if not ctx.train else x

    def backward(self, dy):
        return dy, {}


class Inplace(Layer):
    def forward(self, p, s, x, ctx):
        return x

    def backward(self, dy):
        dy *= 2  # changes the caller's array
        return dy, {}


def test_a_deliberate_error_in_backward_fails_naming_the_parameter():
    with pytest.raises(LayerCheckError) as e:
        check_layer(BadSwiGLU("ffn", hidden=6), (3, 4))
    assert str(e.value).startswith(
        "check_layer(BadSwiGLU 'ffn'): the gradient of parameter 'Wu' is wrong at index"
    )


def test_what_exact_training_relies_on_is_checked():
    with pytest.raises(LayerCheckError, match="backward changed dy"):
        check_layer(Inplace("i"), (3,))


def test_state_kept_outside_the_state_arrays_fails():
    class Counter(Leaky):
        def state_shapes(self):
            return {"n": (1,)}

    with pytest.raises(LayerCheckError, match="outside the state arrays"):
        check_layer(Counter("c"), (3,))


def test_float64_inputs_of_the_users_choice():
    x = np.linspace(-1, 1, 12).reshape(3, 4)
    worst = check_layer(mylayers.RMSNorm("n"), (4,), x=x)
    assert set(worst) == {"gamma", "dx"}


def test_what_check_layer_returns_on_success_is_what_the_docs_show():
    text = (Path(__file__).resolve().parents[2] / "docs" / "layers.md").read_text()
    shown = re.search(r"for the\s+call above, `(\{[^`]*\})`", text)
    assert shown, "docs/layers.md shows no return value of check_layer"
    got = check_layer(mylayers.SwiGLU("ffn", hidden=16), (8, 32))  # the docs' call
    want = ast.literal_eval(shown.group(1))
    assert list(got) == list(want) and all(0 <= v <= 1.0 for v in got.values())
    assert all(got[k] == pytest.approx(want[k], rel=0.01) for k in want), got
