"""Layers of a user's own, as a job names them (``kind: mylayers:RMSNorm``): RMS normalisation,
a SwiGLU feed-forward block, and a layer normalisation written against raysinga's public
kernels (the benchmark's twin of raysinga's own ``layernorm``).

Each computes on ``xp``, NumPy on a CPU and CuPy on a GPU, whichever its inputs are (SwiGLU's
gate through CUDA kernels of its own on a GPU, its NumPy twins on a CPU); keeps
what its backward needs on ``self._cache``; and returns its parameters' gradients in their
shapes and dtype. ``raysinga.nn.testing.check_layer`` checks each against finite differences
(``tests/examples/test_custom_layers.py``).
"""

from __future__ import annotations

import numpy as np

from raysinga import kernels as K
from raysinga.nn import Layer


class RMSNorm(Layer):
    """``x / sqrt(mean(x**2) + eps) * gamma`` over the last axis (no mean taken off, no
    shift), as LLaMA's normalisation."""

    options = {"eps": 1e-6}
    torch_names = (("gamma", "weight", False),)  # torch.nn.RMSNorm's

    def _out_shape(self, in_shape):
        if not in_shape:
            raise self._fail("wants inputs with a feature axis")
        return in_shape

    def param_shapes(self):
        return {"gamma": (self.in_shape[-1],)}

    def init_param(self, local, shape, rng):
        return np.ones(shape)

    def forward(self, p, s, x, ctx):
        xp = K.get_array_module(x)
        rstd = 1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + x.dtype.type(self.opts["eps"]))
        xhat = x * rstd
        self._cache = (xhat, rstd, p["gamma"])
        return xhat * p["gamma"]

    def torch_module(self, torch, dtype):
        return torch.nn.RMSNorm(self.in_shape[-1], eps=self.opts["eps"], dtype=dtype)

    def backward(self, dy):
        xhat, rstd, gamma = self._cache
        f = xhat.shape[-1]
        dgamma = (dy * xhat).reshape(-1, f).sum(axis=0)
        g = dy * gamma
        dx = rstd * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
        return dx, {"gamma": dgamma}


def _gate(a, b):
    """SwiGLU's gate on NumPy: ``silu(a) * b``, and the sigmoid its backward needs."""
    sig = 1.0 / (1.0 + np.exp(-a))
    return sig, a * sig * b


def _gate_grad(dh, a, b, sig):
    """The gradients of the gate's two inputs from the gradient of its output, on NumPy."""
    silu = a * sig
    return dh * b * (sig + silu * (1.0 - sig)), dh * silu


# The gate and its gradient as CUDA kernels of the example's own (docs/layers.md): each call
# runs the kernel on CuPy arrays and the NumPy function beside it on NumPy arrays.
_GATE = K.elementwise_kernel(
    "T a, T b",
    "T sig, T h",
    "sig = 1 / (1 + exp(-a)); h = a * sig * b;",
    name="swiglu_gate",
    cpu=_gate,
)
_GATE_GRAD = K.elementwise_kernel(
    "T dh, T a, T b, T sig",
    "T da, T db",
    "T silu = a * sig; da = dh * b * (sig + silu * (1 - sig)); db = dh * silu;",
    name="swiglu_gate_grad",
    cpu=_gate_grad,
)


class SwiGLU(Layer):
    """The gated feed-forward block of PaLM and LLaMA: ``(silu(x Wg) * (x Wu)) Wd``, from the
    model width through ``hidden`` units back to the model width."""

    options = {"hidden": ...}
    # as three bias-free torch.nn.Linear modules: gate, up and down
    torch_names = (
        ("Wg", "gate.weight", True),
        ("Wu", "up.weight", True),
        ("Wd", "down.weight", True),
    )

    def _out_shape(self, in_shape):
        h = self.opts["hidden"]
        if not isinstance(h, int) or isinstance(h, bool) or h < 1:
            raise self._fail(f"hidden must be a positive integer, got {h!r}")
        if not in_shape:
            raise self._fail("wants inputs with a feature axis")
        return in_shape

    def param_shapes(self):
        d, h = self.in_shape[-1], self.opts["hidden"]
        return {"Wg": (d, h), "Wu": (d, h), "Wd": (h, d)}

    def init_param(self, local, shape, rng):
        return rng.normal(0.0, 1.0 / np.sqrt(shape[0]), size=shape)

    def forward(self, p, s, x, ctx):
        rows = x.reshape(-1, x.shape[-1])
        a, b = rows @ p["Wg"], rows @ p["Wu"]
        sig, h = _GATE(a, b)
        self._cache = (x.shape, rows, a, b, sig, h, p)
        return (h @ p["Wd"]).reshape(x.shape)

    def torch_module(self, torch, dtype):
        d, h = self.in_shape[-1], self.opts["hidden"]

        class SwiGLU(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.gate = torch.nn.Linear(d, h, bias=False, dtype=dtype)
                self.up = torch.nn.Linear(d, h, bias=False, dtype=dtype)
                self.down = torch.nn.Linear(h, d, bias=False, dtype=dtype)

            def forward(self, x):
                return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))

        return SwiGLU()

    def backward(self, dy):
        x_shape, rows, a, b, sig, h, p = self._cache
        dy = dy.reshape(-1, dy.shape[-1])
        da, db = _GATE_GRAD(dy @ p["Wd"].T, a, b, sig)
        dx = da @ p["Wg"].T + db @ p["Wu"].T
        grads = {"Wg": rows.T @ da, "Wu": rows.T @ db, "Wd": h.T @ dy}
        return dx.reshape(x_shape), grads


class UserLayerNorm(Layer):
    """Layer normalisation as raysinga's own ``layernorm`` computes it, through the public
    kernels: what a layer of the user's own costs beside one of raysinga's
    (``benchmarks/bench_custom_layers.py``)."""

    options = {"eps": 1e-5}
    torch_names = (("gamma", "weight", False), ("beta", "bias", False))  # torch.nn.LayerNorm's

    def param_shapes(self):
        return {"gamma": (self.in_shape[-1],), "beta": (self.in_shape[-1],)}

    def init_param(self, local, shape, rng):
        return np.ones(shape) if local == "gamma" else np.zeros(shape)

    def torch_module(self, torch, dtype):
        return torch.nn.LayerNorm(self.in_shape[-1], eps=self.opts["eps"], dtype=dtype)

    def forward(self, p, s, x, ctx):
        rows = x.reshape(-1, self.in_shape[-1])
        y, mean, rstd = K.layernorm_forward(rows, p["gamma"], p["beta"], float(self.opts["eps"]))
        self._cache = (rows, p["gamma"], mean, rstd)
        return y.reshape(x.shape)

    def backward(self, dy):
        rows, gamma, mean, rstd = self._cache
        dx, dgamma, dbeta = K.layernorm_backward(dy.reshape(rows.shape), rows, gamma, mean, rstd)
        return dx.reshape(dy.shape), {"gamma": dgamma, "beta": dbeta}
