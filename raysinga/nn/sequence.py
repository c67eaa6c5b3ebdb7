"""Layers for sequences: embedding, layer and RMS normalisation, GELU, multi-head causal
self-attention, GRU and LSTM, and ``add`` (the sum of earlier layers' outputs, named).

A sequence sample has shape ``(T,)`` (token ids) before an embedding and ``(T, F)`` after it;
a batch adds the leading axis. Weights are stored ``(in, out)`` like a dense layer's; gate blocks
follow PyTorch's order (GRU ``r, z, n``; LSTM ``i, f, g, o``), so an export to PyTorch only
transposes. Every GEMM goes through ``dense_forward``/``dense_backward`` and every per-position
op through the kernels of ``kernels/cpu_seq.py`` (CUDA twins in ``gpu_seq.py``), so the same
code runs on NumPy and CuPy; on a GPU, attention in float32 products is one fused pass
(``kernels/gpu_attention.py``), and in bf16 products cuDNN's flash attention
(``kernels/gpu_cudnn_attention.py``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from raysinga import kernels as K

from .layers import Layer, Shape, check_positive_int


def _xp(a: Any) -> Any:
    return K.get_array_module(a)


class Embedding(Layer):
    """Token ids ``(T,)`` to vectors ``(T, dim)``: row ``i`` of ``W`` (vocab, dim) for id ``i``.
    Initialised N(0, 1), as PyTorch's ``nn.Embedding``."""

    kind = "embedding"
    options = {"vocab": ..., "dim": ...}
    takes_tokens = True

    def _out_shape(self, in_shape: Shape) -> Shape:
        check_positive_int(self, vocab=self.opts["vocab"], dim=self.opts["dim"])
        if len(in_shape) != 1:
            raise self._fail(f"wants a sequence of token ids (T,), got per-sample {in_shape}")
        return (in_shape[0], self.opts["dim"])

    def param_shapes(self) -> dict[str, Shape]:
        return {"W": (self.opts["vocab"], self.opts["dim"])}

    def init_param(self, local, shape, rng):
        return rng.normal(0.0, 1.0, size=shape)

    def forward(self, p, s, x, ctx):
        idx = x.reshape(-1)
        if idx.dtype.kind not in "iu":
            raise self._fail(f"wants integer token ids, got {idx.dtype}; store x as integers")
        self._cache = (idx,)
        return K.embedding_forward(idx, p["W"]).reshape(*x.shape, self.opts["dim"])

    def backward(self, dy):
        (idx,) = self._cache
        dw = K.embedding_backward(idx, dy.reshape(-1, self.opts["dim"]), self.opts["vocab"])
        return None, {"W": dw}


class Positional(Layer):
    """A learnt vector per position added to a sequence ``(T, dim)`` (GPT's position
    embedding; PyTorch: an ``nn.Embedding(T, dim)`` of ``arange(T)``, added). Initialised
    N(0, 0.02)."""

    kind = "positional"

    def _out_shape(self, in_shape: Shape) -> Shape:
        if len(in_shape) != 2:
            raise self._fail(f"wants a sequence of vectors (T, dim), got per-sample {in_shape}")
        return in_shape

    def param_shapes(self) -> dict[str, Shape]:
        return {"W": self.in_shape}

    def init_param(self, local, shape, rng):
        return rng.normal(0.0, 0.02, size=shape)

    def forward(self, p, s, x, ctx):
        return x + p["W"]

    def backward(self, dy):
        rows = dy.reshape(dy.shape[0], -1)
        _, dw = K.bias_act_backward(rows, rows, "linear")  # the batch's sum, in a fixed order
        return dy, {"W": dw.reshape(self.in_shape)}


class LayerNorm(Layer):
    """Normalisation over the last axis of each position, with a learnt scale and shift
    (PyTorch's ``nn.LayerNorm(features)``)."""

    kind = "layernorm"
    options = {"eps": 1e-5}

    def _out_shape(self, in_shape: Shape) -> Shape:
        if not in_shape:
            raise self._fail("wants inputs with a feature axis")
        if not isinstance(self.opts["eps"], (int, float)) or self.opts["eps"] <= 0:
            raise self._fail(f"eps must be a positive number, got {self.opts['eps']!r}")
        return in_shape

    def param_shapes(self) -> dict[str, Shape]:
        return {"gamma": (self.in_shape[-1],), "beta": (self.in_shape[-1],)}

    def init_param(self, local, shape, rng):
        return np.ones(shape) if local == "gamma" else np.zeros(shape)

    def forward(self, p, s, x, ctx):
        f = self.in_shape[-1]
        rows = x.reshape(-1, f)
        y, mean, rstd = K.layernorm_forward(rows, p["gamma"], p["beta"], float(self.opts["eps"]))
        self._cache = (rows, p["gamma"], mean, rstd)
        return y.reshape(x.shape)

    def backward(self, dy):
        rows, gamma, mean, rstd = self._cache
        dx, dgamma, dbeta = K.layernorm_backward(dy.reshape(rows.shape), rows, gamma, mean, rstd)
        return dx.reshape(dy.shape), {"gamma": dgamma, "beta": dbeta}


class RMSNorm(Layer):
    """Scaling of the last axis of each position by the reciprocal of its root mean square,
    with a learnt scale and no shift (PyTorch's ``nn.RMSNorm(features, eps)``)."""

    kind = "rmsnorm"
    options = {"eps": 1e-6}
    _out_shape = LayerNorm._out_shape

    def param_shapes(self) -> dict[str, Shape]:
        return {"gamma": (self.in_shape[-1],)}

    def init_param(self, local, shape, rng):
        return np.ones(shape)

    def forward(self, p, s, x, ctx):
        rows = x.reshape(-1, self.in_shape[-1])
        y, rstd = K.rmsnorm_forward(rows, p["gamma"], float(self.opts["eps"]))
        self._cache = (rows, p["gamma"], rstd)
        return y.reshape(x.shape)

    def backward(self, dy):
        rows, gamma, rstd = self._cache
        dx, dgamma = K.rmsnorm_backward(dy.reshape(rows.shape), rows, gamma, rstd)
        return dx.reshape(dy.shape), {"gamma": dgamma}


class GELU(Layer):
    """GELU with the tanh approximation (PyTorch's ``nn.GELU(approximate="tanh")``)."""

    kind = "gelu"

    def forward(self, p, s, x, ctx):
        y, t = K.gelu_forward(x)
        self._cache = (x, t)
        return y

    def backward(self, dy):
        return K.gelu_backward(dy, *self._cache), {}


class Add(Layer):
    """The sum of the outputs named in ``from`` (a residual connection), as an output of its
    own that later layers can name."""

    kind = "add"

    def forward(self, p, s, x, ctx):
        return x

    def backward(self, dy):
        return dy, {}


def _dense(x, w, b):
    return K.dense_forward(x, w, b, "linear")


def _heads(proj: Any) -> tuple[Any, Any, Any]:
    """Views ``(n, h, t, hd)`` of queries, keys and values in a projection laid out
    ``(n, t, 3, h, hd)``: each head's rows are BLAS-ready as they lie."""
    return tuple(proj[:, :, j].transpose(0, 2, 1, 3) for j in range(3))


class Attention(Layer):
    """Multi-head causal self-attention over ``(T, dim)``: position ``t`` attends to positions
    ``0..t``. ``Wqkv`` (dim, 3 dim) projects to queries, keys and values (each split into
    ``heads`` heads of ``dim / heads``), ``Wo`` (dim, dim) projects the heads' concatenation
    back. On a CPU the softmax of the scaled, masked scores is one fused op between two
    matrix products; on a GPU with float32 products and heads of at most 64, scores, softmax
    and the product with the values are one pass that never writes the (T, T) scores.

    The heads' width is read off the parameters: ``Wqkv`` (dim, 3 w) and ``Wo`` (w, dim) for
    ``w`` = dim, or a share of the heads' when the layer's heads are split across workers
    (:mod:`raysinga.nn.partition`), each part computing its own heads."""

    kind = "attention"
    options = {"heads": ...}

    def _out_shape(self, in_shape: Shape) -> Shape:
        check_positive_int(self, heads=self.opts["heads"])
        if len(in_shape) != 2:
            raise self._fail(f"wants a sequence of vectors (T, dim), got per-sample {in_shape}")
        if in_shape[1] % self.opts["heads"]:
            raise self._fail(f"dim {in_shape[1]} is not a multiple of heads {self.opts['heads']}")
        return in_shape

    def param_shapes(self) -> dict[str, Shape]:
        d = self.in_shape[1]
        return {"Wqkv": (d, 3 * d), "bqkv": (3 * d,), "Wo": (d, d), "bo": (d,)}

    def init_param(self, local, shape, rng):
        if local.startswith("b"):
            return np.zeros(shape)
        limit = math.sqrt(6.0 / (shape[0] + shape[1] // (3 if local == "Wqkv" else 1)))
        return rng.uniform(-limit, limit, size=shape)  # Glorot, per projection

    def forward(self, p, s, x, ctx):
        xp = _xp(x)
        n, t, d = x.shape
        h, w = self.opts["heads"], p["Wqkv"].shape[1] // 3  # w: the heads' width
        hd = w // h
        rows = x.reshape(n * t, d)
        qkv = _dense(rows, p["Wqkv"], p["bqkv"])
        # The queries scaled by 1/sqrt(hd) where they lie (a quarter of the scores' size), so
        # that the scores need no pass of their own; the backward pass scales dq the same way.
        qkv[:, :w] *= qkv.dtype.type(1.0 / math.sqrt(hd))
        self._fused = K.fused_attention_fits(qkv.reshape(n, t, 3 * w), hd)
        if self._fused:
            # One pass on the GPU, keeping each row's log-sum-exp instead of the (T, T)
            # probabilities; heads wider than the kernels' tiles take the products below.
            merged, lse = K.fused_attention_forward(qkv.reshape(n, t, 3 * w), h, 1.0)
            merged = merged.reshape(n * t, w)
            y = _dense(merged, p["Wo"], p["bo"])
            self._cache = (rows, qkv, lse, merged, y, p["Wqkv"], p["Wo"])
            return y.reshape(n, t, d)
        q, k, v = _heads(qkv.reshape(n, t, 3, h, hd))
        scores = K.matmul(q, k.transpose(0, 1, 3, 2)).reshape(n * h, t, t)
        probs = K.causal_softmax_forward(scores, 1.0).reshape(n, h, t, t)
        merged = xp.empty((n, t, h, hd), x.dtype)
        K.matmul(probs, v, out=merged.transpose(0, 2, 1, 3))  # the heads side by side
        merged = merged.reshape(n * t, w)
        y = _dense(merged, p["Wo"], p["bo"])
        self._cache = (rows, qkv, q, k, v, probs, merged, y, p["Wqkv"], p["Wo"])
        return y.reshape(n, t, d)

    def backward(self, dy):
        if self._fused:
            return self._fused_backward(dy)
        rows, qkv, q, k, v, probs, merged, y, wqkv, wo = self._cache
        xp = _xp(dy)
        n, h, t, hd = q.shape
        d = wo.shape[1]
        dmerged, dwo, dbo = K.dense_backward(merged, wo, y, dy.reshape(n * t, d), "linear", True)
        dheads = dmerged.reshape(n, t, h, hd).transpose(0, 2, 1, 3)
        dprobs = K.matmul(dheads, v.transpose(0, 1, 3, 2))
        dscores = K.causal_softmax_backward(
            dprobs.reshape(n * h, t, t), probs.reshape(n * h, t, t), 1.0
        ).reshape(n, h, t, t)
        dqkv = xp.empty((n, t, 3, h, hd), dy.dtype)  # laid out as the projection's output
        dq, dk, dv = _heads(dqkv)
        K.matmul(dscores, k, out=dq)
        K.matmul(dscores.transpose(0, 1, 3, 2), q, out=dk)  # q is scaled already
        K.matmul(probs.transpose(0, 1, 3, 2), dheads, out=dv)
        return self._projection_backward(rows, wqkv, qkv, dqkv, dwo, dbo, (n, t, d))

    def _fused_backward(self, dy):
        rows, qkv, lse, merged, y, wqkv, wo = self._cache
        n, t, d = dy.shape
        w = wo.shape[0]  # the heads' width
        dmerged, dwo, dbo = K.dense_backward(merged, wo, y, dy.reshape(n * t, d), "linear", True)
        dqkv = K.fused_attention_backward(
            dmerged.reshape(n, t, w), qkv.reshape(n, t, 3 * w), merged.reshape(n, t, w), lse,
            self.opts["heads"], 1.0,
        )  # fmt: skip
        return self._projection_backward(rows, wqkv, qkv, dqkv, dwo, dbo, (n, t, d))

    def _projection_backward(self, rows, wqkv, qkv, dqkv, dwo, dbo, shape):
        """The input projection's gradients from ``dqkv`` (laid out as ``qkv``), its queries'
        part still to be scaled as the forward pass scaled the queries; ``shape`` is x's."""
        n, t, d = shape
        w = wqkv.shape[1] // 3  # the heads' width
        dqkv = dqkv.reshape(n * t, 3 * w)
        dqkv[:, :w] *= dqkv.dtype.type(1.0 / math.sqrt(w // self.opts["heads"]))
        dx, dwqkv, dbqkv = K.dense_backward(rows, wqkv, qkv, dqkv, "linear", self.need_dx)
        grads = {"Wqkv": dwqkv, "bqkv": dbqkv, "Wo": dwo, "bo": dbo}
        return (None if dx is None else dx.reshape(n, t, d)), grads


class _Recurrent(Layer):
    """A recurrent layer over ``(T, features)`` returning every step's hidden state
    ``(T, units)``, from a zero initial state. ``Wx`` (features, G units) and ``Wh`` (units,
    G units) with biases ``bx``, ``bh``: PyTorch's ``weight_ih``, ``weight_hh``, ``bias_ih``,
    ``bias_hh``, transposed. Initialised U(-1/sqrt(units), 1/sqrt(units)), as PyTorch's."""

    options = {"units": ...}
    gates = 0

    def _out_shape(self, in_shape: Shape) -> Shape:
        check_positive_int(self, units=self.opts["units"])
        if len(in_shape) != 2:
            raise self._fail(f"wants a sequence of vectors (T, features), got {in_shape}")
        return (in_shape[0], self.opts["units"])

    def param_shapes(self) -> dict[str, Shape]:
        u, g = self.opts["units"], self.gates * self.opts["units"]
        return {"Wx": (self.in_shape[1], g), "Wh": (u, g), "bx": (g,), "bh": (g,)}

    def init_param(self, local, shape, rng):
        bound = 1.0 / math.sqrt(self.opts["units"])
        return rng.uniform(-bound, bound, size=shape)

    def _start(self, p, x):
        """The input projection of every step in one GEMM, and the buffers a forward pass
        fills: ``(xp, rows, gx, out, hprev, h)``, ``h`` the zero initial state."""
        xp = _xp(x)
        n, t, f = x.shape
        u = self.opts["units"]
        rows = x.reshape(n * t, f)
        gx = _dense(rows, p["Wx"], p["bx"]).reshape(n, t, -1)
        out, hprev = xp.empty((n, t, u), x.dtype), xp.empty((n, t, u), x.dtype)
        return xp, rows, gx, out, hprev, xp.zeros((n, u), x.dtype)

    def _weights_backward(self, p, rows, gx, dgx, hprev, dgh):
        """The input and recurrent weights' gradients from every step's gate gradients, in
        two GEMMs (the steps summed in a fixed order)."""
        n, t, g = dgx.shape
        u = self.opts["units"]
        dx, dwx, dbx = K.dense_backward(
            rows, p["Wx"], gx.reshape(n * t, g), dgx.reshape(n * t, g), "linear", self.need_dx
        )
        _, dwh, dbh = K.dense_backward(
            hprev.reshape(n * t, u), p["Wh"], dgh.reshape(n * t, g),
            dgh.reshape(n * t, g), "linear", False,
        )  # fmt: skip
        grads = {"Wx": dwx, "Wh": dwh, "bx": dbx, "bh": dbh}
        return (None if dx is None else dx.reshape(n, t, -1)), grads


class GRU(_Recurrent):
    """Gated recurrent unit (PyTorch's ``nn.GRU(batch_first=True)``, one layer)."""

    kind = "gru"
    gates = 3

    def forward(self, p, s, x, ctx):
        xp, rows, gx, out, hprev, h = self._start(p, x)
        n, t, u = out.shape
        saved = xp.empty((n, t, 4 * u), x.dtype)
        for step in range(t):
            hprev[:, step] = h
            gh = _dense(h, p["Wh"], p["bh"])
            h, saved[:, step] = K.gru_cell_forward(xp.ascontiguousarray(gx[:, step]), gh, h)
            out[:, step] = h
        self._cache = (p, rows, gx, hprev, saved)
        return out

    def backward(self, dy):
        p, rows, gx, hprev, saved = self._cache
        xp = _xp(dy)
        n, t, u = dy.shape
        dgx = xp.empty((n, t, 3 * u), dy.dtype)
        dgh = xp.empty((n, t, 3 * u), dy.dtype)
        wh_t = xp.ascontiguousarray(p["Wh"].T)
        dh = xp.zeros((n, u), dy.dtype)
        for step in reversed(range(t)):
            dh = dh + dy[:, step]
            dgx[:, step], dgh[:, step], direct = K.gru_cell_backward(
                dh, xp.ascontiguousarray(saved[:, step]), xp.ascontiguousarray(hprev[:, step])
            )
            dh = direct + K.matmul(dgh[:, step], wh_t)
        return self._weights_backward(p, rows, gx, dgx, hprev, dgh)


class LSTM(_Recurrent):
    """Long short-term memory (PyTorch's ``nn.LSTM(batch_first=True)``, one layer)."""

    kind = "lstm"
    gates = 4

    def forward(self, p, s, x, ctx):
        xp, rows, gx, out, hprev, h = self._start(p, x)
        n, t, u = out.shape
        cells = xp.zeros((n, t + 1, u), x.dtype)  # cells[:, s] is the cell entering step s
        acts = xp.empty((n, t, 4 * u), x.dtype)
        for step in range(t):
            hprev[:, step] = h
            g = gx[:, step] + _dense(h, p["Wh"], p["bh"])
            h, cells[:, step + 1], acts[:, step] = K.lstm_cell_forward(
                g, xp.ascontiguousarray(cells[:, step])
            )
            out[:, step] = h
        self._cache = (p, rows, gx, hprev, cells, acts)
        return out

    def backward(self, dy):
        p, rows, gx, hprev, cells, acts = self._cache
        xp = _xp(dy)
        n, t, u = dy.shape
        dg = xp.empty((n, t, 4 * u), dy.dtype)
        wh_t = xp.ascontiguousarray(p["Wh"].T)
        dh = xp.zeros((n, u), dy.dtype)
        dc = xp.zeros((n, u), dy.dtype)
        for step in reversed(range(t)):
            dh = dh + dy[:, step]
            dg[:, step], dc = K.lstm_cell_backward(
                dh,
                dc,
                xp.ascontiguousarray(acts[:, step]),
                xp.ascontiguousarray(cells[:, step]),
                xp.ascontiguousarray(cells[:, step + 1]),
            )
            dh = K.matmul(dg[:, step], wh_t)
        return self._weights_backward(p, rows, gx, dg, hprev, dg)


SEQUENCE_LAYERS: tuple[type[Layer], ...] = (
    Embedding,
    Positional,
    LayerNorm,
    RMSNorm,
    GELU,
    Add,
    Attention,
    GRU,
    LSTM,
)
