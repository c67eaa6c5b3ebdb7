"""Layer kinds and losses of the user's own (raysinga/nn/registry.py): named by import path or
registered from Python, and each way of naming nothing usable refused in one line."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from raysinga.nn import Layer, ModelSpec, Net, StepContext, register_layer, register_loss, registry

SCALE = """
import numpy as np
from raysinga.nn import Layer

class Scale(Layer):
    options = {"init": 1.0}

    def param_shapes(self):
        return {"s": (self.in_shape[-1],)}

    def init_param(self, local, shape, rng):
        return np.full(shape, self.opts["init"])

    def forward(self, p, s, x, ctx):
        self._cache = (x, p["s"])
        return x * p["s"]

    def backward(self, dy):
        x, s = self._cache
        return dy * s, {"s": (dy * x).reshape(-1, x.shape[-1]).sum(axis=0)}

NOT_A_LAYER = 3

def half_squares(out, target, denom):
    d = out - target.reshape(out.shape)
    return (d * d).sum() / (2 * denom), d / denom
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the user's own on the path, as a job's ``modules`` puts it there."""
    name = f"userlayers_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(SCALE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def spec(kind: str, loss: str = "mse", **opts) -> dict:
    return {
        "input_shape": [4],
        "layers": [
            {"kind": "dense", "name": "fc", "units": 3},
            {"kind": kind, "name": "sc", **opts},
        ],
        "loss": loss,
    }


def test_a_layer_named_by_import_path_builds_and_trains(user_module):
    net = Net(ModelSpec.from_dict(spec(f"{user_module}:Scale", init=2.0)))
    assert type(net.layers[1]).__name__ == "Scale" and net.layers[1].kind == f"{user_module}:Scale"
    params = net.init_params(0)
    assert params["sc/s"].tolist() == [2.0, 2.0, 2.0]
    x, y = np.ones((5, 4), np.float32), np.zeros((5, 3), np.float32)
    loss, grads, _ = net.loss_and_grads(params, {}, x, y, StepContext(train=True))
    assert set(grads) == {"fc/W", "fc/b", "sc/s"} and grads["sc/s"].dtype == np.float32
    assert ModelSpec.from_dict(spec(f"{user_module}:Scale")).own_kinds() == [f"{user_module}:Scale"]


def test_a_loss_named_by_import_path(user_module):
    net = Net(ModelSpec.from_dict(spec("relu", loss=f"{user_module}:half_squares")))
    out = np.ones((2, 3), np.float32)
    loss, d = net.loss_fn(out, np.zeros((2, 3), np.float32), 2)
    assert float(loss) == pytest.approx(1.5) and d.shape == (2, 3)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (
            "nosuchmodule_xyz:Scale",
            "model.layers[1].kind: layer 'nosuchmodule_xyz:Scale': module 'nosuchmodule_xyz' "
            "cannot be imported here; name the file or package in the job's `modules`",
        ),
        ("{m}:Missing", "model.layers[1].kind: layer '{m}:Missing': module '{m}' has no 'Missing'"),
        (
            "{m}:NOT_A_LAYER",
            "model.layers[1].kind: layer kind '{m}:NOT_A_LAYER' is the int 3, not a layer "
            "(a subclass of raysinga.nn.Layer)",
        ),
        ("{m}:", "model.layers[1].kind: layer '{m}:': an import path is 'module:name'"),
        ("sclae", "model.layers[1].kind: unknown layer kind 'sclae'; allowed: add, attention"),
    ],
)
def test_a_kind_that_names_nothing_usable_is_one_line(user_module, kind, message):
    with pytest.raises(ValueError) as e:
        ModelSpec.from_dict(spec(kind.format(m=user_module)))
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(message.format(m=user_module))


def test_a_module_that_fails_to_import_says_how(tmp_path, monkeypatch):
    (tmp_path / "brokenlayers_q.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ValueError,
        match=r"importing module 'brokenlayers_q' failed: "
        r"RuntimeError: no GPU here$",
    ):
        ModelSpec.from_dict(spec("brokenlayers_q:Scale"))


def test_a_module_whose_own_import_is_missing_says_which(tmp_path, monkeypatch):
    (tmp_path / "needy_q.py").write_text("import not_installed_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as e:
        ModelSpec.from_dict(spec("needy_q:Scale"))
    assert str(e.value) == (
        "model.layers[1].kind: layer 'needy_q:Scale': importing module 'needy_q' failed: module "
        "'not_installed_xyz' is not installed here"
    )


def test_a_loss_that_names_nothing_usable_is_one_line(user_module):
    with pytest.raises(ValueError, match=r"^model.loss: unknown loss 'msee'; allowed: mse"):
        ModelSpec.from_dict(spec("relu", loss="msee"))
    with pytest.raises(
        ValueError, match=r"^model.loss: loss '.*:Scale' is .*Scale, not a function$"
    ):
        ModelSpec.from_dict(spec("relu", loss=f"{user_module}:Scale"))


def test_registered_layers_and_losses(monkeypatch):
    monkeypatch.setattr(registry, "_layers", {})
    monkeypatch.setattr(registry, "_losses", {})

    @register_layer("twice")
    class Twice(Layer):
        def forward(self, p, s, x, ctx):
            return x * 2

        def backward(self, dy):
            return dy * 2, {}

    register_loss(
        "l1sum", lambda out, t, denom: (abs(out - t).sum() / denom, np.sign(out - t) / denom)
    )
    net = Net(ModelSpec.from_dict(spec("twice", loss="l1sum")))
    assert isinstance(net.layers[1], Twice) and net.layers[1].kind == "twice"
    assert register_layer("twice", Twice) is Twice  # again, the same class: no harm
    with pytest.raises(ValueError, match="layer kind 'twice' is already registered to"):
        register_layer("twice", type("Other", (Twice,), {}))
    with pytest.raises(ValueError, match="layer kind 'dense' is raysinga's own"):
        register_layer("dense", Twice)
    with pytest.raises(ValueError, match="layer kind 'x' is builtins.int, not a layer"):
        register_layer("x", int)
    with pytest.raises(ValueError, match="a non-empty name without ':'"):
        register_layer("a:b", Twice)
    with pytest.raises(ValueError, match="loss 'mse' is raysinga's own"):
        register_loss("mse", lambda *a: a)


def test_a_users_layer_options_are_checked_as_raysingas_own(user_module):
    with pytest.raises(ValueError) as e:
        ModelSpec.from_dict(spec(f"{user_module}:Scale", inti=2.0))
    assert str(e.value) == (
        "model.layers[1]: layer 'sc' (Scale): unknown option(s) ['inti']; allowed: ['init']"
    )
