"""What a layer declares, checked as the net is built, and one small run of each layer of the
user's own when a job is read (:func:`probe`): a layer that breaks its own declarations fails
there with one line naming the layer and what it broke, before any role starts. The fuller
check, with finite differences, is :func:`raysinga.nn.testing.check_layer`."""

from __future__ import annotations

from typing import Any

import numpy as np

from .layers import Layer, StepContext, param_rng
from .registry import error_line, is_own, is_own_loss

PROBE_BATCH = 2


def _is_shape(v: Any) -> bool:
    return isinstance(v, tuple) and all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in v
    )


def described(a: Any) -> str:
    """An array's shape and dtype as a message shows them (or what it is instead)."""
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        return f"a {type(a).__name__}"
    return f"{tuple(a.shape)} {np.dtype(a.dtype)}"


def check_declared(layer: Layer, out_shape: Any) -> None:
    """A layer's declarations after :meth:`~.Layer.build`: its output shape, its parameters'
    and state's names and shapes. Raises ValueError naming the layer and what is wrong."""
    if not _is_shape(out_shape) or any(d < 1 for d in out_shape):
        raise layer._fail(
            f"build returned {out_shape!r}, not the shape of one sample's output "
            "(a tuple of positive integers)"
        )
    params, state = layer.param_shapes(), layer.state_shapes()
    for what, decl in (("param_shapes", params), ("state_shapes", state)):
        if not isinstance(decl, dict):
            raise layer._fail(f"{what}() returned a {type(decl).__name__}, not {{name: shape}}")
        for name, shape in decl.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise layer._fail(f"{what}(): {name!r} is not a name (non-empty, without '/')")
            if not _is_shape(shape):
                raise layer._fail(f"{what}(): {name!r} has shape {shape!r}, not a tuple of sizes")
    both = sorted(set(params) & set(state))
    if both:
        raise layer._fail(f"name {both[0]!r} is used twice: by a parameter and by a state array")


def probe(net: Any) -> None:
    """Run each layer of the user's own once, forward and backward, on a batch of
    :data:`PROBE_BATCH` samples in the net's dtype, and the user's own loss once; raise
    ValueError with one line where a result breaks the declarations (an output of another
    shape or dtype, a gradient of the wrong shape or dtype, a gradient for no parameter or none
    for one). raysinga's own layers are tested with raysinga and are not run here."""
    rng = np.random.default_rng(0)
    names = [ly.name for ly in net.layers]
    for i, ls in enumerate(net.spec.layers):
        if is_own(ls.kind):
            continue
        if net.sources[i] is not None:
            in_shape = net.out_shapes[names.index(net.sources[i][0])]
        else:
            in_shape = net.out_shapes[i - 1] if i else tuple(net.spec.input_shape)
        _probe_layer(
            f"model.layers[{i}] ({ls.name}, {ls.kind})", net.layers[i], in_shape, net.dtype, rng
        )
    if not is_own_loss(net.spec.loss):
        _probe_loss(net, rng)


def _probe_layer(where: str, layer: Layer, in_shape: tuple, dtype: np.dtype, rng: Any) -> None:
    n = PROBE_BATCH
    tokens = bool(getattr(layer, "takes_tokens", False))
    if tokens:
        x = np.zeros((n, *in_shape), np.int64)
    else:
        x = rng.standard_normal((n, *in_shape)).astype(dtype)
    params = {}
    for local, shape in layer.param_shapes().items():
        v = np.asarray(layer.init_param(local, shape, param_rng(0, layer.key(local))))
        if v.shape != shape:
            raise ValueError(f"{where}: init_param({local!r}) gave {v.shape}; declared {shape}")
        params[local] = v.astype(dtype)
    state = {}
    for local, shape in layer.state_shapes().items():
        v = np.asarray(layer.init_state(local, shape))
        if v.shape != shape:
            raise ValueError(f"{where}: init_state({local!r}) gave {v.shape}; declared {shape}")
        state[layer.key(local)] = v.astype(dtype)
    try:
        y = layer.forward(params, state, x, StepContext(train=True))
    except Exception as e:
        raise ValueError(f"{where}: forward failed on a batch of {n}: {error_line(e)}") from None
    want = (n, *layer.out_shape)
    if getattr(y, "shape", None) != want or y.dtype != dtype:
        raise ValueError(
            f"{where}: forward returned {described(y)} for inputs {described(x)}; "
            f"it declares {layer.out_shape} per sample: {want} {np.dtype(dtype)}"
        )
    try:
        out = layer.backward(rng.standard_normal(want).astype(dtype))
    except Exception as e:
        raise ValueError(f"{where}: backward failed on a batch of {n}: {error_line(e)}") from None
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise ValueError(f"{where}: backward returned {described(out)}, not (dx, {{name: grad}})")
    dx, grads = out
    missing, extra = sorted(set(params) - set(grads)), sorted(set(grads) - set(params))
    if missing:
        raise ValueError(f"{where}: backward returned no gradient for {missing}")
    if extra:
        raise ValueError(f"{where}: backward returned gradients for {extra}: no such parameter")
    for local, g in grads.items():
        if getattr(g, "shape", None) != params[local].shape or g.dtype != dtype:
            raise ValueError(
                f"{where}: backward's gradient of {local!r} is {described(g)}; "
                f"the parameter is {described(params[local])}"
            )
    if layer.need_dx and not tokens:
        if getattr(dx, "shape", None) != x.shape or dx.dtype != dtype:
            raise ValueError(
                f"{where}: backward's dx is {described(dx)}; the inputs were {described(x)}"
            )


def _probe_loss(net: Any, rng: Any) -> None:
    opts = net.spec.loss_options
    where = f"model.loss ({net.spec.loss}{f', options {opts}' if opts else ''})"
    n = PROBE_BATCH
    out = rng.standard_normal((n, *net.output_shape)).astype(net.dtype)
    labels = np.zeros(out.shape[:-1], np.int64)
    try:  # class labels first, then targets shaped as the outputs
        loss, dout = net.loss_fn(out, labels, n)
    except Exception as e:
        if net.classifies:  # it said it takes class labels: its own error is the one to show
            why = error_line(e)
            raise ValueError(f"{where}: failed on outputs {described(out)}: {why}") from None
        try:
            loss, dout = net.loss_fn(out, rng.standard_normal(out.shape).astype(net.dtype), n)
        except Exception as e:
            why = error_line(e)
            raise ValueError(f"{where}: failed on outputs {described(out)}: {why}") from None
    if np.ndim(loss) != 0:
        raise ValueError(f"{where}: returned a loss of shape {np.shape(loss)}, not a scalar")
    if getattr(dout, "shape", None) != out.shape or dout.dtype != out.dtype:
        raise ValueError(
            f"{where}: its gradient is {described(dout)}; the outputs were {described(out)}"
        )
