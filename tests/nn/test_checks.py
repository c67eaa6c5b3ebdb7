"""A layer of the user's own that breaks what it declares is refused as the job is read, in
one line naming the layer and what it broke (raysinga/nn/checks.py)."""

from __future__ import annotations

import numpy as np
import pytest

from raysinga.nn import Layer, ModelSpec, Net, StepContext, register_layer, registry


class Good(Layer):
    """``x * w``: one parameter of the inputs' width."""

    def param_shapes(self):
        return {"w": (self.in_shape[-1],)}

    def init_param(self, local, shape, rng):
        return np.ones(shape)

    def forward(self, p, s, x, ctx):
        self._cache = (x, p["w"])
        return x * p["w"]

    def backward(self, dy):
        x, w = self._cache
        return dy * w, {"w": (dy * x).sum(axis=0)}


class WrongOutput(Good):
    def forward(self, p, s, x, ctx):
        return super().forward(p, s, x, ctx)[:, :2]


class WrongGradShape(Good):
    def backward(self, dy):
        dx, g = super().backward(dy)
        return dx, {"w": g["w"][:1]}


class WrongGradDtype(Good):
    def backward(self, dy):
        dx, g = super().backward(dy)
        return dx, {"w": g["w"].astype(np.float64)}


class NoGrad(Good):
    def backward(self, dy):
        return super().backward(dy)[0], {}


class NameTwice(Good):
    def state_shapes(self):
        return {"w": (1,)}


class BadDeclaredShape(Good):
    def param_shapes(self):
        return {"w": [self.in_shape[-1]]}


class WrongDx(Good):
    def backward(self, dy):
        return dy[:, :1], super().backward(dy)[1]


class Raises(Good):
    def forward(self, p, s, x, ctx):
        raise KeyError("gamma")


class PairsOnly(Good):
    """Right on the check's batch of two, wrong on any other."""

    def forward(self, p, s, x, ctx):
        return super().forward(p, s, x, ctx).reshape(2, -1)

    def backward(self, dy):
        return super().backward(dy.reshape(-1, *self.in_shape))


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.setattr(registry, "_layers", {})
    for cls in (
        Good,
        WrongOutput,
        WrongGradShape,
        WrongGradDtype,
        NoGrad,
        NameTwice,
        BadDeclaredShape,
        WrongDx,
        Raises,
        PairsOnly,
    ):
        register_layer(cls.__name__.lower(), cls)


def spec(kind: str) -> dict:
    return {
        "input_shape": [4],
        "layers": [{"kind": "dense", "name": "fc", "units": 3}, {"kind": kind, "name": "mine"}],
        "loss": "mse",
    }


@pytest.mark.parametrize(
    ("kind", "line"),
    [
        (
            "wrongoutput",
            "model.layers[1] (mine, wrongoutput): forward returned (2, 2) float32 for "
            "inputs (2, 3) float32; it declares (3,) per sample: (2, 3) float32",
        ),
        (
            "wronggradshape",
            "model.layers[1] (mine, wronggradshape): backward's gradient of 'w' is "
            "(1,) float32; the parameter is (3,) float32",
        ),
        (
            "wronggraddtype",
            "model.layers[1] (mine, wronggraddtype): backward's gradient of 'w' is "
            "(3,) float64; the parameter is (3,) float32",
        ),
        ("nograd", "model.layers[1] (mine, nograd): backward returned no gradient for ['w']"),
        (
            "nametwice",
            "model.layers[1]: layer 'mine' (nametwice): name 'w' is used twice: by a "
            "parameter and by a state array",
        ),
        (
            "baddeclaredshape",
            "model.layers[1]: layer 'mine' (baddeclaredshape): param_shapes(): "
            "'w' has shape [3], not a tuple of sizes",
        ),
        (
            "wrongdx",
            "model.layers[1] (mine, wrongdx): backward's dx is (2, 1) float32; the inputs "
            "were (2, 3) float32",
        ),
        (
            "raises",
            "model.layers[1] (mine, raises): forward failed on a batch of 2: KeyError: 'gamma'",
        ),
    ],
)
def test_a_layer_that_breaks_its_declarations_is_refused_in_one_line(kind, line):
    with pytest.raises(ValueError) as e:
        ModelSpec.from_dict(spec(kind))
    assert str(e.value) == line


def test_a_layer_that_keeps_them_passes():
    ModelSpec.from_dict(spec("good"))


def test_a_loss_of_the_users_own_is_run_once(monkeypatch):
    monkeypatch.setattr(registry, "_losses", {})
    registry.register_loss("vector", lambda out, t, denom: (out.sum(axis=0), out))
    with pytest.raises(
        ValueError, match=r"^model.loss \(vector\): returned a loss of shape \(3,\), not a scalar$"
    ):
        ModelSpec.from_dict({**spec("good"), "loss": "vector"})


@pytest.mark.parametrize(
    ("after", "line"),
    [
        (
            {"kind": "dense", "name": "out", "units": 2},
            "model.layers[2] (out, dense) failed on a batch of 8: dense: input (2, 12) does not "
            "match weight (3, 2); its input came from model.layers[1] (mine, pairsonly), which "
            "gave (2, 12) float32 where it declares (3,) per sample",
        ),
        (
            {"kind": "add", "name": "res", "from": ["fc", "mine"]},
            "model.layers[2] (res, add) failed on a batch of 8: operands could not be "
            "broadcast together with shapes (8,3) (2,12); its input came from "
            "model.layers[0] (fc, dense), which gave (8, 3) float32 and model.layers[1] (mine, "
            "pairsonly), which gave (2, 12) float32 where it declares (3,) per sample",
        ),
    ],
)
def test_a_layer_that_breaks_on_a_real_batch_is_named_with_the_layer_before_it(after, line):
    layers = [*spec("pairsonly")["layers"], after]
    net = Net(ModelSpec.from_dict({**spec("pairsonly"), "layers": layers}))
    x = np.ones((8, 4), np.float32)
    with pytest.raises(ValueError) as e:
        net.forward(net.init_params(0), {}, x, StepContext(train=True))
    assert str(e.value) == line
