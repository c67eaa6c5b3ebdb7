"""A loss of the user's own (docs/layers.md; the example's examples/custom_layers/mylosses.py):
named by a string or as ``{kind: ..., option: value}``, its options checked as a layer's are,
and accuracy where it says that it classifies."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from raysinga.nn import ModelSpec, Net, StepContext
from raysinga.nn.losses import softmax_cross_entropy

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_layers"

PLAIN = """
def half_squares(out, target, denom):
    d = out - target.reshape(out.shape)
    return (d * d).sum() / (2 * denom), d / denom

def needs_scale(out, target, denom, *, scale):
    d = out - target.reshape(out.shape)
    return scale * (d * d).sum() / denom, 2 * scale * d / denom
"""


@pytest.fixture
def losses(tmp_path, monkeypatch):
    """The example's ``mylosses`` and a module of plain losses, on the path as a job's
    ``modules`` puts them there."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    (tmp_path / "plainlosses_u.py").write_text(textwrap.dedent(PLAIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("mylosses", "plainlosses_u"):
        sys.modules.pop(name, None)


def spec(loss) -> dict:
    return {
        "input_shape": [4],
        "layers": [{"kind": "dense", "name": "fc", "units": 3}],
        "loss": loss,
    }


def test_a_loss_takes_its_options_from_the_job(losses):
    rng = np.random.default_rng(0)
    out, labels = rng.standard_normal((5, 3)), rng.integers(0, 3, 5)
    plain = ModelSpec.from_dict(spec("mylosses:smooth_ce"))
    assert plain.loss == "mylosses:smooth_ce" and plain.loss_options == {}
    assert plain.to_dict()["loss"] == "mylosses:smooth_ce"  # the digest as it always was
    none = ModelSpec.from_dict(spec({"kind": "mylosses:smooth_ce", "smoothing": 0.0}))
    assert none.to_dict()["loss"] == {"kind": "mylosses:smooth_ce", "smoothing": 0.0}
    assert ModelSpec.from_dict(none.to_dict()) == none and none.digest() != plain.digest()
    got, want = Net(none).loss_fn(out, labels, 8), softmax_cross_entropy(out, labels, 8)
    assert got[0] == pytest.approx(want[0]) and np.allclose(got[1], want[1])
    default = Net(plain).loss_fn(out, labels, 8)[0]  # smoothing 0.1, the function's default
    assert default != pytest.approx(want[0])
    smoothed = ModelSpec.from_dict(spec({"kind": "mylosses:smooth_ce", "smoothing": 0.1}))
    assert Net(smoothed).loss_fn(out, labels, 8)[0] == default


@pytest.mark.parametrize(
    ("loss", "line"),
    [
        (
            {"kind": "mylosses:smooth_ce", "smothing": 0.1},
            "model.loss: loss 'mylosses:smooth_ce': unknown option(s) ['smothing']; "
            "allowed: ['smoothing']",
        ),
        (
            {"kind": "plainlosses_u:needs_scale"},
            "model.loss: loss 'plainlosses_u:needs_scale': missing option(s) ['scale']",
        ),
        (
            {"kind": "mse", "scale": 2},
            "model.loss: loss 'mse': unknown option(s) ['scale']; it takes none",
        ),
        (
            {"kind": "mylosses:smooth_ce", "smoothing": 1.5},
            "model.loss (mylosses:smooth_ce, options {'smoothing': 1.5}): failed on outputs "
            "(2, 3) float32: ValueError: smoothing must be in [0, 1), got 1.5",
        ),
        (
            {"kind": "mylosses:smooth_ce", "smoothing": "a lot"},
            "model.loss (mylosses:smooth_ce, options {'smoothing': 'a lot'}): failed on outputs "
            "(2, 3) float32: ValueError: smoothing must be a number in [0, 1), got 'a lot'",
        ),
        (
            {"smoothing": 0.1},
            "model.loss: a mapping names its loss as 'kind' beside its options, got "
            "{'smoothing': 0.1}",
        ),
    ],
)
def test_an_unknown_missing_or_bad_option_is_one_line(losses, loss, line):
    with pytest.raises(ValueError) as e:
        ModelSpec.from_dict(spec(loss))
    assert str(e.value) == line


def test_a_loss_that_says_it_classifies_has_an_accuracy(losses):
    x, y = np.eye(4, dtype=np.float32)[:3], np.array([0, 1, 2])
    for loss, classifies in (
        ("mylosses:smooth_ce", True),
        ({"kind": "mylosses:smooth_ce", "smoothing": 0.2}, True),
        ("softmax_cross_entropy", True),
        ("plainlosses_u:half_squares", False),
        ("mse", False),
    ):
        net = Net(ModelSpec.from_dict(spec(loss)))
        params = net.init_params(0)
        target = y if classifies else np.zeros((3, 3), np.float32)
        _, acc = net.evaluate(params, {}, x, target)
        assert net.classifies is classifies and (acc is not None) is classifies, loss


def test_a_loss_divided_by_denom_sums_over_a_groups_workers_and_a_batch_mean_does_not(losses):
    """What docs/layers.md says of ``denom``: two workers of a group, each on its half of the
    batch with the group's batch size as ``denom``, sum to the one process's gradient; a loss
    that divides by its own batch instead gives twice it."""
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, 4)).astype(np.float32), rng.integers(0, 3, 8)
    net = Net(ModelSpec.from_dict(spec("mylosses:smooth_ce")))
    params = net.init_params(0)

    def grads(x, y, denom):
        return net.loss_and_grads(params, {}, x, y, StepContext(train=True), denom)[1]["fc/W"]

    whole = grads(x, y, 8)
    np.testing.assert_allclose(grads(x[:4], y[:4], 8) + grads(x[4:], y[4:], 8), whole, 1e-5)
    own_mean = grads(x[:4], y[:4], 4) + grads(x[4:], y[4:], 4)  # each half's own mean
    np.testing.assert_allclose(own_mean, 2 * whole, 1e-5)
