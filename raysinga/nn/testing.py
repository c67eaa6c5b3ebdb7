"""Checks for a layer, the user's own or raysinga's: :func:`check_layer` runs it in float64
against finite differences, and checks what raysinga's exact training relies on (shapes and
dtypes as declared, inputs left alone, the same bits from the same step, state kept where a
checkpoint sees it). Every layer of raysinga's own passes it (``tests/nn/test_testing.py``).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from .checks import check_declared, described
from .layers import Layer, StepContext, param_rng


class LayerCheckError(AssertionError):
    """What :func:`check_layer` found wrong; the message names the layer and the parameter."""


def check_layer(
    layer: Layer,
    in_shape: tuple[int, ...],
    *,
    x: Any = None,
    batch: int = 3,
    seed: int = 0,
    train: bool = True,
    eps: float = 1e-6,
    atol: float = 1e-6,
    rtol: float = 1e-5,
    samples: int = 48,
) -> dict[str, float]:
    """Check ``layer`` (made but not built: ``RMSNorm("norm", eps=1e-6)``) on inputs of one
    sample's shape ``in_shape``, a batch of ``batch`` (or the inputs ``x``: token ids for a
    layer that takes them, by default ``0 .. vocab-1`` where it has a ``vocab`` option).

    In float64, with the parameters as the layer initialises them (seed ``seed``), for a
    random projection ``L = sum(r * forward(x))``: the gradient backward gives for each
    parameter and for the inputs agrees with central differences of ``L`` (step ``eps``) at up
    to ``samples`` entries each, within ``atol + rtol * |difference|``. Also:

    - the output has the declared shape, in float64 and float32 alike, in the inputs' dtype;
      each gradient has its parameter's shape and dtype, dx the inputs';
    - forward and backward leave the inputs, the parameters and ``dy`` alone;
    - the same step gives the same bits twice (``train``: dropout's masks come from the step);
    - the state (as batch norm's statistics) lives in the state arrays: a new layer given a
      copy of them computes the same outputs.

    Returns the largest error relative to the tolerance per checked array (``dx`` for the
    inputs; at most 1.0 where all pass). Raises :class:`LayerCheckError` naming the layer and
    the parameter at the first failure."""
    name = f"{type(layer).__name__} {layer.name!r}"

    def fail(msg: str) -> LayerCheckError:
        return LayerCheckError(f"check_layer({name}): {msg}")

    in_shape = tuple(in_shape)
    try:
        out_shape = layer.build(in_shape)
        check_declared(layer, out_shape)
    except ValueError as e:
        raise fail(str(e)) from None
    rng = np.random.default_rng(seed)
    tokens = bool(getattr(layer, "takes_tokens", False))
    if x is None:
        if tokens:
            vocab = int(layer.opts.get("vocab", 2))
            x = rng.integers(0, vocab, size=(batch, *in_shape))
        else:
            x = rng.standard_normal((batch, *in_shape))
    x = np.asarray(x) if tokens else np.asarray(x, np.float64)
    params = {
        local: np.asarray(
            layer.init_param(local, shape, param_rng(seed, layer.key(local))), np.float64
        )
        for local, shape in layer.param_shapes().items()
    }
    state0 = {
        layer.key(local): np.asarray(layer.init_state(local, shape), np.float64)
        for local, shape in layer.state_shapes().items()
    }
    ctx = StepContext(train=train, seed=seed, step=1)

    def run(p: dict, xx: Any, state: dict | None = None) -> Any:
        return layer.forward(p, copy.deepcopy(state0) if state is None else state, xx, ctx)

    # -- shapes, dtypes, sameness, inputs left alone
    for dtype in (np.float32, np.float64):
        p = {k: v.astype(dtype) for k, v in params.items()}
        xx = x if tokens else x.astype(dtype)
        kept = (copy.deepcopy(p), np.array(xx, copy=True))
        y = run(p, xx)
        if getattr(y, "shape", None) != (len(x), *out_shape) or y.dtype != dtype:
            raise fail(
                f"forward gave {described(y)}; declared {(len(x), *out_shape)} {np.dtype(dtype)}"
            )
        again = run(p, xx)
        if again.tobytes() != y.tobytes():
            raise fail(
                f"forward gave other bits the second time at the same step ({np.dtype(dtype)})"
            )
        dy = rng.standard_normal(y.shape).astype(dtype)
        dy_kept = dy.copy()
        dx, grads = layer.backward(dy)
        for local, g in grads.items():
            if local not in p:
                raise fail(f"backward gave a gradient for {local!r}, which is not a parameter")
            if getattr(g, "shape", None) != p[local].shape or g.dtype != dtype:
                raise fail(
                    f"the gradient of parameter {local!r} is {described(g)}; the parameter is "
                    f"{described(p[local])}"
                )
        missing = sorted(set(p) - set(grads))
        if missing:
            raise fail(f"backward gave no gradient for parameter {missing[0]!r}")
        if (
            not tokens
            and layer.need_dx
            and (getattr(dx, "shape", None) != xx.shape or dx.dtype != dtype)
        ):
            raise fail(f"dx is {described(dx)}; the inputs are {described(xx)}")
        for local, v in p.items():
            if v.tobytes() != kept[0][local].tobytes():
                raise fail(f"forward or backward changed parameter {local!r}")
        if np.asarray(xx).tobytes() != kept[1].tobytes():
            raise fail("forward or backward changed its inputs")
        if dy.tobytes() != dy_kept.tobytes():
            raise fail("backward changed dy")

    # -- state where a checkpoint sees it
    if state0:
        state = copy.deepcopy(state0)
        layer.forward(params, state, x, ctx)  # a training step moves the statistics
        twin = type(layer)(layer.name, **{k: v for k, v in layer.opts.items()})
        twin.build(in_shape)
        ev = StepContext(train=False, seed=seed, step=2)
        a = layer.forward(params, copy.deepcopy(state), x, ev)
        b = twin.forward(params, copy.deepcopy(state), x, ev)
        if np.asarray(a).tobytes() != np.asarray(b).tobytes():
            raise fail(
                "its outputs depend on what it keeps outside the state arrays, which a "
                "checkpoint does not keep"
            )

    # -- gradients against finite differences, in float64
    r = rng.standard_normal((len(x), *out_shape))
    y = run(params, x)
    dx, grads = layer.backward(r.copy())

    def loss(p: dict, xx: Any) -> float:
        return float(np.sum(r * run(p, xx)))

    worst: dict[str, float] = {}
    for local, value in params.items():
        worst[local] = _compare(
            fail,
            f"parameter {local!r}",
            value,
            np.asarray(grads[local]),
            eps,
            atol,
            rtol,
            samples,
            rng,
            lambda v, local=local: loss({**params, local: v}, x),
        )
    if not tokens and layer.need_dx:
        worst["dx"] = _compare(
            fail,
            "the inputs (dx)",
            x,
            np.asarray(dx),
            eps,
            atol,
            rtol,
            samples,
            rng,
            lambda v: loss(params, v),
        )
    return worst


def _compare(fail, what, value, analytic, eps, atol, rtol, samples, rng, f) -> float:
    """The worst error over tolerance at up to ``samples`` entries of ``value``."""
    n = value.size
    idx = np.arange(n) if n <= samples else np.sort(rng.choice(n, samples, replace=False))
    worst = 0.0
    for i in idx:
        plus, minus = value.copy(), value.copy()
        plus.flat[i] += eps
        minus.flat[i] -= eps
        numeric = (f(plus) - f(minus)) / (2 * eps)
        got = float(analytic.flat[i])
        err = abs(got - numeric) / (atol + rtol * abs(numeric))
        worst = max(worst, err)
        if err > 1.0:
            where = np.unravel_index(i, value.shape)
            raise fail(
                f"the gradient of {what} is wrong at index {tuple(int(w) for w in where)}: "
                f"backward gives {got:.6g}, finite differences {numeric:.6g}"
            )
    return worst
