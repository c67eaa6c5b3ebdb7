"""Layers: named pieces of a net with parameters, non-trainable state and a backward pass.

A layer holds no parameter values itself: ``forward`` reads them from the flat ``params`` dict the
net passes in (keys ``"<layer>/<param>"``), so the same layer code serves the single-process
reference, a worker that receives parameters from servers, and a checkpoint loader. ``forward``
keeps what ``backward`` needs on the layer, so a layer object serves one forward/backward at a time.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from raysinga import kernels as K

Shape = tuple[int, ...]


@dataclass(frozen=True)
class StepContext:
    """What randomness and mode depend on: never on which worker computes a sample."""

    train: bool
    seed: int = 0
    step: int = 0
    sample_offset: int = 0  # index of the batch's first row within the global batch
    # A step recorded as a CUDA graph (kernels.gpu_graph.StepValues): what depends on the step
    # is read from device memory there, so that every replay uses its own step's values.
    values: Any = None


class Layer:
    kind: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}  # option name -> default (required ones: ...)

    def __init__(self, name: str, **opts: Any) -> None:
        kind = self.kind or type(self).__name__
        unknown = set(opts) - set(self.options)
        if unknown:
            raise ValueError(
                f"layer {name!r} ({kind}): unknown option(s) {sorted(unknown)}; "
                f"allowed: {sorted(self.options)}"
            )
        missing = [k for k, v in self.options.items() if v is ... and k not in opts]
        if missing:
            raise ValueError(f"layer {name!r} ({kind}): missing option(s) {missing}")
        self.name = name
        self.opts = {**self.options, **opts}
        self.in_shape: Shape = ()
        self.out_shape: Shape = ()
        self.need_dx = True  # a net's first layer has no one to pass dx to
        # Where backward may write its parameters' gradients (local name -> an array of the
        # parameter's shape and dtype), set by the net for one call; a layer that does not
        # returns fresh arrays, which the net's caller copies there.
        self.grads_into: dict[str, Any] = {}
        # Set by the net for one call where its caller wants each layer's gradients as soon
        # as they are final: a layer that can hands its parameters' gradients (local name ->
        # array) over before it computes its dx, which may still read its parameters.
        self.grads_ready: Callable[[dict[str, Any]], None] | None = None
        # Set likewise where the caller wants a parameter's gradient by blocks of rows as each
        # is final (a dense layer's weight, written in place into ``grads_into``).
        self.rows_hook: RowsHook | None = None
        self.dw_row_blocks = 1  # a dense weight's gradient in blocks of rows (dw_row_blocks)
        self._cache: tuple = ()

    # -- shapes and initial values
    def build(self, in_shape: Shape) -> Shape:
        """Check the input shape (without batch axis) and return the output shape."""
        self.in_shape = tuple(in_shape)
        self.out_shape = self._out_shape(self.in_shape)
        return self.out_shape

    def _out_shape(self, in_shape: Shape) -> Shape:
        return in_shape

    def param_shapes(self) -> dict[str, Shape]:
        return {}

    def state_shapes(self) -> dict[str, Shape]:
        return {}

    def init_param(self, local: str, shape: Shape, rng: np.random.Generator) -> np.ndarray:
        return np.zeros(shape)

    def init_state(self, local: str, shape: Shape) -> np.ndarray:
        return np.zeros(shape)

    # -- compute
    def forward(self, p: dict, s: dict, x: Any, ctx: StepContext) -> Any:
        raise NotImplementedError

    def backward(self, dy: Any) -> tuple[Any, dict]:
        """``(dx, grads)`` with ``grads`` keyed by the local parameter name."""
        return dy, {}

    def key(self, local: str) -> str:
        return f"{self.name}/{local}"

    def uniform(self, ctx: StepContext, like: Any) -> Any:
        """Draws in ``[0, 1)`` shaped and typed as ``like`` (a batch, on its device): this
        layer's random stream at the step of ``ctx``. Each draw is a pure function of the
        job's seed, the step, the layer's name, the global index of its sample (``ctx``'s
        ``sample_offset`` plus its row) and its place in the sample, as dropout's masks are:
        a sample draws the same numbers whichever worker computes it, and a step recomputed
        after a loss draws them again. Not for a step recorded as a CUDA graph, whose replays
        would repeat the recorded step's draws."""
        n = like.shape[0] if like.ndim else 1
        key = K.dropout_key(ctx.seed, ctx.step, self.name)
        xp = K.get_array_module(like)
        z = K.common.draws24(xp, key, ctx.sample_offset, n, like.size // n if n else 0)
        return (z.astype(like.dtype) * like.dtype.type(2.0**-24)).reshape(like.shape)

    def _fail(self, msg: str) -> ValueError:
        return ValueError(f"layer {self.name!r} ({self.kind or type(self).__name__}): {msg}")


def _fan_init(shape: Shape, fan_in: int, fan_out: int, act: str, rng) -> np.ndarray:
    # He for ReLU, Glorot otherwise: keeps activations' variance roughly constant.
    if act == "relu":
        return rng.normal(0.0, math.sqrt(2.0 / fan_in), size=shape)
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape)


def check_positive_int(layer: Layer, **vals: Any) -> None:
    for k, v in vals.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise layer._fail(f"{k} must be a positive integer, got {v!r}")


# In a job summed by hosts (topology.reduce: hosts), a dense layer's weight gradient of at
# least DW_BLOCKED_ELEMENTS elements is computed on a CPU as DW_ROW_BLOCKS GEMMs, each over a
# block of its rows: a worker sends each block's rows to their servers while it computes the
# next (actors.hostsum.worker_side.EarlySends), instead of waiting for the whole GEMM. Every path of
# such a job computes it so (its workers, and the single process of --local: the same bits);
# any other job keeps one GEMM (the blocks cost a single process with two BLAS threads about
# 5% of a step of a 784-1024-1024-10 MLP). A smaller weight is one part's worth
# (actors.exchange.wire.PART_BYTES) or less: its blocks would let nothing go sooner, and each costs
# a call (about 5 us).
DW_ROW_BLOCKS = 4
DW_BLOCKED_ELEMENTS = 1 << 16


def dw_row_blocks(reduce: str) -> int:
    """The blocks of rows a dense weight's gradient is computed in, in a job whose
    ``topology.reduce`` is ``reduce`` (every path of one job: the same)."""
    return DW_ROW_BLOCKS if reduce == "hosts" else 1


class RowsHook(Protocol):
    """Told of a parameter's gradient final by blocks of flat elements as a layer computes it
    (:class:`actors.hostsum.worker_side.EarlySends`)."""

    def first_block(self, key: str, bounds: Sequence[int]) -> int:
        """Which block (of those ``bounds`` cut parameter ``key`` into) to compute first."""
        ...

    def rows_final(self, key: str, start: int, stop: int) -> None:
        """Elements ``[start, stop)`` of ``key``'s gradient are final."""
        ...


class Dense(Layer):
    kind = "dense"
    options = {"units": ..., "activation": "linear"}

    def _out_shape(self, in_shape: Shape) -> Shape:
        check_positive_int(self, units=self.opts["units"])
        K.common.check_activation(self.opts["activation"])
        if len(in_shape) not in (1, 2):
            raise self._fail(
                f"wants flat inputs (features,) or a sequence (T, features), got per-sample "
                f"shape {in_shape}; add a flatten"
            )
        return (*in_shape[:-1], self.opts["units"])  # on a sequence: at every position

    def param_shapes(self) -> dict[str, Shape]:
        return {"W": (self.in_shape[-1], self.opts["units"]), "b": (self.opts["units"],)}

    def init_param(self, local, shape, rng):
        if local == "b":
            return np.zeros(shape)
        return _fan_init(shape, shape[0], shape[1], self.opts["activation"], rng)

    def forward(self, p, s, x, ctx):
        rows = x.reshape(-1, x.shape[-1])
        y = K.dense_forward(rows, p["W"], p["b"], self.opts["activation"])
        self._cache = (x.shape, rows, p["W"], y)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def backward(self, dy):
        x_shape, rows, w, y = self._cache
        out, hook = self.grads_into.get("W"), self.rows_hook
        blocks = self.dw_row_blocks if w.size >= DW_BLOCKED_ELEMENTS else 1
        first, told = 0, None
        if hook is not None and out is not None and blocks > 1:  # told where they are written
            key, units = self.key("W"), w.shape[1]
            bounds = [r * units for r in K.row_bounds(w.shape[0], blocks)]
            first = hook.first_block(key, bounds)
            told = lambda a, b: hook.rows_final(key, a * units, b * units)  # noqa: E731
        dx, dw, db = K.dense_backward(
            rows,
            w,
            y,
            dy.reshape(y.shape),
            self.opts["activation"],
            self.need_dx,
            dw_out=out,
            grads_ready=None if self.grads_ready is None else self._ready,
            row_blocks=blocks,
            first_block=first,
            rows_ready=told,
        )
        return (None if dx is None else dx.reshape(x_shape)), {"W": dw, "b": db}

    def _ready(self, dw: Any, db: Any) -> None:
        assert self.grads_ready is not None
        self.grads_ready({"W": dw, "b": db})


class Conv2D(Layer):
    kind = "conv2d"
    options = {"filters": ..., "kernel": ..., "stride": 1, "padding": 0, "activation": "linear"}

    def _out_shape(self, in_shape: Shape) -> Shape:
        o = self.opts
        check_positive_int(self, filters=o["filters"], kernel=o["kernel"], stride=o["stride"])
        if not isinstance(o["padding"], int) or o["padding"] < 0:
            raise self._fail(f"padding must be a non-negative integer, got {o['padding']!r}")
        K.common.check_activation(o["activation"])
        if len(in_shape) != 3:
            raise self._fail(f"wants (channels, height, width) inputs, got {in_shape}")
        c, h, w = in_shape
        k, st, pd = o["kernel"], o["stride"], o["padding"]
        try:
            oh, ow = K.common.conv_out_size(h, k, st, pd), K.common.conv_out_size(w, k, st, pd)
        except ValueError as e:
            raise self._fail(str(e)) from None
        return (o["filters"], oh, ow)

    def param_shapes(self) -> dict[str, Shape]:
        k = self.opts["kernel"]
        return {"W": (self.opts["filters"], self.in_shape[0], k, k), "b": (self.opts["filters"],)}

    def init_param(self, local, shape, rng):
        if local == "b":
            return np.zeros(shape)
        o, c, kh, kw = shape
        return _fan_init(shape, c * kh * kw, o * kh * kw, self.opts["activation"], rng)

    def forward(self, p, s, x, ctx):
        o = self.opts
        y, cols = K.conv2d_forward(x, p["W"], p["b"], o["stride"], o["padding"], o["activation"])
        self._cache = (x.shape, cols, p["W"], y)
        return y

    def backward(self, dy):
        x_shape, cols, w, y = self._cache
        o = self.opts
        dx, dw, db = K.conv2d_backward(
            dy, y, cols, w, x_shape, o["stride"], o["padding"], o["activation"], self.need_dx
        )
        return dx, {"W": dw, "b": db}


class _Pool(Layer):
    options = {"kernel": ..., "stride": None, "padding": 0}

    def _out_shape(self, in_shape: Shape) -> Shape:
        o = self.opts
        if o["stride"] is None:
            o["stride"] = o["kernel"]
        check_positive_int(self, kernel=o["kernel"], stride=o["stride"])
        if len(in_shape) != 3:
            raise self._fail(f"wants (channels, height, width) inputs, got {in_shape}")
        k, st, pd = o["kernel"], o["stride"], o["padding"]
        if not isinstance(pd, int) or pd < 0 or 2 * pd > k:
            raise self._fail(f"padding must be an integer in [0, kernel/2], got {pd!r}")
        c, h, w = in_shape
        try:
            return (c, K.common.conv_out_size(h, k, st, pd), K.common.conv_out_size(w, k, st, pd))
        except ValueError as e:
            raise self._fail(str(e)) from None


class MaxPool2D(_Pool):
    kind = "maxpool"

    def forward(self, p, s, x, ctx):
        o = self.opts
        y, arg = K.maxpool_forward(x, o["kernel"], o["stride"], o["padding"])
        self._cache = (x.shape, arg)
        return y

    def backward(self, dy):
        x_shape, arg = self._cache
        o = self.opts
        return K.maxpool_backward(dy, arg, x_shape, o["kernel"], o["stride"], o["padding"]), {}


class AvgPool2D(_Pool):
    kind = "avgpool"

    def forward(self, p, s, x, ctx):
        o = self.opts
        self._cache = (x.shape,)
        return K.avgpool_forward(x, o["kernel"], o["stride"], o["padding"])

    def backward(self, dy):
        o = self.opts
        return K.avgpool_backward(dy, self._cache[0], o["kernel"], o["stride"], o["padding"]), {}


class Activation(Layer):
    """A standalone activation (``relu``, ``sigmoid``, ``tanh``)."""

    def forward(self, p, s, x, ctx):
        y = K.activation_forward(x, self.kind)
        self._cache = (y,)
        return y

    def backward(self, dy):
        return K.activation_backward(dy, self._cache[0], self.kind), {}


class ReLU(Activation):
    kind = "relu"


class Sigmoid(Activation):
    kind = "sigmoid"


class Tanh(Activation):
    kind = "tanh"


class Flatten(Layer):
    kind = "flatten"

    def _out_shape(self, in_shape: Shape) -> Shape:
        return (int(np.prod(in_shape)),)

    def forward(self, p, s, x, ctx):
        self._cache = (x.shape,)
        return x.reshape(x.shape[0], -1)

    def backward(self, dy):
        return dy.reshape(self._cache[0]), {}


class Dropout(Layer):
    """Inverted dropout whose mask depends on (seed, step, layer name, global sample index)."""

    kind = "dropout"
    options = {"rate": ...}

    def _out_shape(self, in_shape: Shape) -> Shape:
        r = self.opts["rate"]
        if not isinstance(r, (int, float)) or not 0.0 <= r < 1.0:
            raise self._fail(f"rate must be a number in [0, 1), got {r!r}")
        return in_shape

    def forward(self, p, s, x, ctx):
        if not ctx.train or self.opts["rate"] == 0:
            self._cache = (None,)
            return x
        key = K.dropout_key(ctx.seed, ctx.step, self.name)
        on_device = None
        if ctx.values is not None:  # a replayed graph draws the mask of its own step
            name = self.name
            on_device = ctx.values.ints(
                f"dropout/{name}",
                2,
                lambda _, c: (K.dropout_key(c.seed, c.step, name), c.sample_offset),
            )
        rate = float(self.opts["rate"])
        mask = K.dropout_mask(x, rate, key, ctx.sample_offset, key_offset=on_device)
        self._cache = (mask,)
        return x * mask

    def backward(self, dy):
        mask = self._cache[0]
        return (dy if mask is None else dy * mask), {}


class BatchNorm(Layer):
    """Batch normalisation over the channel axis (axis 1 of (N, C) or NCHW inputs).

    Running statistics follow PyTorch's convention: ``running = (1 - momentum) * running +
    momentum * batch``, with the unbiased batch variance; they are non-trainable state.
    """

    kind = "batchnorm"
    options = {"momentum": 0.1, "eps": 1e-5}

    def _out_shape(self, in_shape: Shape) -> Shape:
        if len(in_shape) not in (1, 3):
            raise self._fail(f"wants (features,) or (channels, h, w) inputs, got {in_shape}")
        if not 0.0 <= self.opts["momentum"] <= 1.0 or self.opts["eps"] <= 0:
            raise self._fail("momentum must be in [0, 1] and eps > 0")
        return in_shape

    def param_shapes(self) -> dict[str, Shape]:
        return {"gamma": (self.in_shape[0],), "beta": (self.in_shape[0],)}

    def state_shapes(self) -> dict[str, Shape]:
        return {"running_mean": (self.in_shape[0],), "running_var": (self.in_shape[0],)}

    def init_param(self, local, shape, rng):
        return np.ones(shape) if local == "gamma" else np.zeros(shape)

    def init_state(self, local, shape):
        return np.ones(shape) if local == "running_var" else np.zeros(shape)

    def forward(self, p, s, x, ctx):
        eps = self.opts["eps"]
        if not ctx.train:
            mean, var = s[self.key("running_mean")], s[self.key("running_var")]
            return K.batchnorm_forward_infer(x, p["gamma"], p["beta"], mean, var, eps)
        y, mean, var, inv_std = K.batchnorm_forward_train(x, p["gamma"], p["beta"], eps)
        m = x.size // x.shape[1]
        mom = self.opts["momentum"]
        unbiased = var * (m / max(m - 1, 1))
        for local, batch in (("running_mean", mean), ("running_var", unbiased)):
            r = s[self.key(local)]
            r[...] = (1 - mom) * r + mom * batch
        self._cache = (x, p["gamma"], mean, inv_std)
        return y

    def backward(self, dy):
        x, gamma, mean, inv_std = self._cache
        dx, dgamma, dbeta = K.batchnorm_backward(dy, x, gamma, mean, inv_std)
        return dx, {"gamma": dgamma, "beta": dbeta}


def param_rng(seed: int, key: str) -> np.random.Generator:
    """The generator that initialises parameter ``key``: independent of every other parameter."""
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(key.encode())]))
