"""SINGA's model partitioning, as tensor parallelism: a layer's features split across the ``k``
workers of a partition, each holding and computing its part (SINGA's ``partition_dim: 1``;
Megatron-LM's tensor parallelism).

What one part of each split layer computes, given the other parts through an
:class:`Exchange` (the sum of the parts' arrays, or their concatenation, in part order):

- ``dense`` by output columns (:class:`ColumnDense`), followed by a ``dense`` by input rows
  (:class:`RowDense`), as a pair: the first takes the whole input and gives its columns of
  the output (its activation applies element by element, on each part's own), the second
  takes those columns and gives its share of the output, which the parts sum before its bias
  and activation. The pair costs one sum forward (after the second) and one backward (the
  first's input gradient).
- ``attention`` by heads (:class:`HeadAttention`): each part projects the input to its own
  heads' queries, keys and values, attends within them and projects its heads back by its
  rows of ``Wo``; the parts sum, then the output bias is added. One sum each way.
- ``embedding`` by vocabulary (:class:`VocabEmbedding`, each part holds a range of the rows
  and gives zeros for the ids outside it; the parts sum) or by dimension
  (:class:`DimEmbedding`, each part holds a range of the columns; the parts concatenate).

The parts' parameters are the whole parameter's ranges (:func:`split`), so a checkpoint holds
the whole parameter (:func:`join`) and resumes under any other ``k``. Every sum adds the parts
in part order, so a step under the same ``k`` gives the same bits each time; against the layer
unsplit it differs by float rounding only (a product's terms are added in another order).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from raysinga import kernels as K

from .layers import Dense, Layer, StepContext
from .sequence import Attention, Embedding

# What each kind may be split by (the ``by`` of :func:`split`), and what it then needs.
SPLITS: dict[str, tuple[str, ...]] = {
    "dense": ("columns", "rows"),  # columns then rows: a pair
    "attention": ("heads",),
    "embedding": ("vocab", "dim"),
}


class Exchange(Protocol):
    """One part's side of what the parts of a split layer hand one another. Every part calls
    each method in the same order with arrays of the same shape; each returns the same bits
    on every part."""

    parts: int
    part: int

    def sum(self, x: Any) -> Any:
        """The parts' ``x`` added in part order."""
        ...

    def gather(self, x: Any, axis: int) -> Any:
        """The parts' ``x`` concatenated along ``axis`` in part order."""
        ...


class LocalExchange:
    """The parts as threads of one process (each part one thread, :meth:`group` making their
    exchanges): what a group's workers on one host do through shared memory, in memory."""

    def __init__(self, parts: int, part: int, shared: _Slots) -> None:
        self.parts, self.part, self._shared = parts, part, shared

    @staticmethod
    def group(parts: int, timeout_s: float = 60.0) -> list[LocalExchange]:
        shared = _Slots(parts, timeout_s)
        return [LocalExchange(parts, p, shared) for p in range(parts)]

    def sum(self, x: Any) -> Any:
        xs = self._shared.swap(self.part, x)
        out = xs[0].copy()
        for y in xs[1:]:
            out += y
        return out

    def gather(self, x: Any, axis: int) -> Any:
        xs = self._shared.swap(self.part, x)
        return K.get_array_module(x).concatenate(xs, axis=axis)


class _Slots:
    """Each part's array for one exchange, handed to all once all are in."""

    def __init__(self, parts: int, timeout_s: float) -> None:
        self.slots: list[Any] = [None] * parts
        self.barrier = threading.Barrier(parts, timeout=timeout_s)

    def swap(self, part: int, x: Any) -> list[Any]:
        self.slots[part] = x
        self.barrier.wait()  # every part's array is in
        xs = list(self.slots)
        self.barrier.wait()  # every part has read them: the slots may be reused
        return xs


# ---------------------------------------------------------------- the parts' parameters


def ranges(n: int, parts: int, what: str, layer: str) -> list[tuple[int, int]]:
    """``n`` cut into ``parts`` equal ranges; refused, naming the layer, where they are not."""
    if parts < 1 or n % parts:
        raise ValueError(f"layer {layer!r}: its {what} ({n}) do not split into {parts} equal parts")
    step = n // parts
    return [(i * step, (i + 1) * step) for i in range(parts)]


def split(
    layer: Layer, by: str, params: dict[str, np.ndarray], parts: int
) -> list[dict[str, np.ndarray]]:
    """The layer's parameters (local names) as each part holds them, ``by`` one of
    :data:`SPLITS`' for its kind. A parameter every part needs whole (the bias of a dense
    split by rows, of an attention's output) is in every part: its gradient is the same on
    every part, and only part 0's is the layer's."""
    kind, name = layer.kind, layer.name
    if by not in SPLITS.get(kind, ()):
        can = SPLITS.get(kind)
        raise ValueError(
            f"layer {name!r} ({kind}): cannot be split by {by!r}"
            + (f" (it splits by {', '.join(can)})" if can else " (this kind is not split)")
        )
    if kind == "dense" and by == "columns":
        cuts = ranges(params["W"].shape[1], parts, "units", name)
        return [{"W": params["W"][:, a:b], "b": params["b"][a:b]} for a, b in cuts]
    if kind == "dense":
        cuts = ranges(params["W"].shape[0], parts, "input features", name)
        return [{"W": params["W"][a:b], "b": params["b"]} for a, b in cuts]
    if kind == "attention":
        heads = layer.opts["heads"]
        width = params["Wo"].shape[0] // heads
        out = []
        for a, b in ranges(heads, parts, "heads", name):
            cols = _qkv_columns(params["Wqkv"].shape[1] // 3, a * width, b * width)
            out.append(
                {
                    "Wqkv": params["Wqkv"][:, cols],
                    "bqkv": params["bqkv"][cols],
                    "Wo": params["Wo"][a * width : b * width],
                    "bo": params["bo"],
                }
            )
        return out
    if by == "vocab":
        return [{"W": params["W"][a:b]} for a, b in ranges(params["W"].shape[0], parts, by, name)]
    cuts = ranges(params["W"].shape[1], parts, "dims", name)
    return [{"W": params["W"][:, a:b]} for a, b in cuts]


def join(layer: Layer, by: str, parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The whole parameters (or gradients) from the parts' (:func:`split`'s inverse): what a
    checkpoint holds, whatever ``k`` wrote it. A parameter every part holds whole is part
    0's."""
    first = parts[0]
    if layer.kind == "dense" and by == "columns":
        return {
            "W": np.concatenate([p["W"] for p in parts], axis=1),
            "b": np.concatenate([p["b"] for p in parts]),
        }
    if layer.kind == "dense":
        return {"W": np.concatenate([p["W"] for p in parts]), "b": first["b"]}
    if layer.kind == "attention":
        w = first["Wqkv"].shape[1] // 3  # a part's heads' width
        qkv = [
            np.concatenate([p[k][..., j * w : (j + 1) * w] for p in parts], axis=-1)
            for k in ("Wqkv", "bqkv")
            for j in range(3)
        ]
        return {
            "Wqkv": np.concatenate(qkv[:3], axis=1),
            "bqkv": np.concatenate(qkv[3:]),
            "Wo": np.concatenate([p["Wo"] for p in parts]),
            "bo": first["bo"],
        }
    return {"W": np.concatenate([p["W"] for p in parts], axis=0 if by == "vocab" else 1)}


def _qkv_columns(width: int, a: int, b: int) -> np.ndarray:
    """The columns of ``Wqkv`` (queries, keys, values side by side, each ``width`` wide) of
    the heads whose columns are ``[a, b)`` within each."""
    return np.concatenate([np.arange(j * width + a, j * width + b) for j in range(3)])


# ---------------------------------------------------------------- one part of a split layer


class _Part:
    """What a net asks of a layer, for one part of a split one: its name and kind, its part's
    parameter shapes, ``forward(p, s, x, ctx)`` and ``backward(dy)`` (so that a net of parts,
    :func:`part_net`, is a :class:`~.model.Net` whose split layers are these)."""

    def __init__(self, layer: Layer, by: str, ex: Exchange) -> None:
        self.name, self.kind, self.by, self.ex = layer.name, layer.kind, by, ex
        self.in_shape, self.out_shape = layer.in_shape, layer.out_shape
        whole = {k: np.empty(v, np.float32) for k, v in layer.param_shapes().items()}
        self._shapes = {k: v.shape for k, v in split(layer, by, whole, ex.parts)[ex.part].items()}
        self.need_dx = layer.need_dx
        # what a net sets around a call; a part computes its gradients into new arrays
        self.grads_into: dict[str, Any] = {}
        self.grads_ready = self.rows_hook = None

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}

    def key(self, local: str) -> str:
        return f"{self.name}/{local}"


class ColumnDense(_Part):
    """Part ``ex.part`` of a dense layer split by output columns: the whole input in, its
    columns of the output (activation applied) out; backward, the input's gradient summed
    over the parts."""

    def __init__(self, layer: Dense, ex: Exchange) -> None:
        super().__init__(layer, "columns", ex)
        self.layer = copy.copy(layer)  # its own copy: a layer keeps one call's state

    def forward(self, p: dict, s: dict, x: Any, ctx: StepContext) -> Any:
        return self.layer.forward(p, s, x, ctx)

    def backward(self, dy: Any) -> tuple[Any, dict]:
        self.layer.need_dx = self.need_dx
        dx, grads = self.layer.backward(dy)
        return (None if dx is None else self.ex.sum(dx)), grads


class RowDense(_Part):
    """Part ``ex.part`` of a dense layer split by input rows: its columns of the input in (a
    :class:`ColumnDense`'s output), the parts' products summed, then the bias and activation
    applied, the whole output out on every part; backward, the gradient of its own input
    columns, no exchange."""

    def __init__(self, layer: Dense, ex: Exchange) -> None:
        super().__init__(layer, "rows", ex)
        self.layer = layer
        self._cache: tuple = ()

    def forward(self, p: dict, s: dict, x: Any, ctx: StepContext) -> Any:
        rows = x.reshape(-1, x.shape[-1])
        partial = K.matmul(rows, p["W"])
        y = K.bias_act_forward(self.ex.sum(partial), p["b"], self.layer.opts["activation"])
        self._cache = (x.shape, rows, p["W"], y)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def backward(self, dy: Any) -> tuple[Any, dict]:
        x_shape, rows, w, y = self._cache
        dz, db = K.bias_act_backward(dy.reshape(y.shape), y, self.layer.opts["activation"])
        dw = K.matmul(rows.T, dz)
        dx = K.matmul(dz, w.T).reshape(x_shape) if self.need_dx else None
        return dx, {"W": dw, "b": db}


class HeadAttention(_Part):
    """Part ``ex.part`` of an attention layer split by heads: the whole input in, its heads'
    attention projected back by its rows of ``Wo``, the parts summed, then the output bias
    added; the whole output out on every part. Backward, the input's gradient summed over the
    parts."""

    def __init__(self, layer: Attention, ex: Exchange) -> None:
        super().__init__(layer, "heads", ex)
        heads = layer.opts["heads"]
        # the same computation on this part's heads, without the output bias (added once,
        # after the sum)
        self.inner = Attention(layer.name, heads=heads // ex.parts)
        self.inner.build(layer.in_shape)
        self.inner.need_dx = layer.need_dx

    def forward(self, p: dict, s: dict, x: Any, ctx: StepContext) -> Any:
        xp = K.get_array_module(x)
        own = {**p, "bo": xp.zeros_like(p["bo"])}
        partial = self.inner.forward(own, {}, x, ctx)
        n, t, d = partial.shape
        y = K.bias_act_forward(self.ex.sum(partial).reshape(n * t, d), p["bo"], "linear")
        return y.reshape(n, t, d)

    def backward(self, dy: Any) -> tuple[Any, dict]:
        self.inner.need_dx = self.need_dx
        dx, grads = self.inner.backward(dy)  # its "bo" is the sum of dy's rows: bo's gradient
        return (None if dx is None else self.ex.sum(dx)), grads


class VocabEmbedding(_Part):
    """Part ``ex.part`` of an embedding split by vocabulary: the rows of its range of ids,
    zeros for the others, summed over the parts; backward, its rows' gradient."""

    def __init__(self, layer: Embedding, ex: Exchange) -> None:
        super().__init__(layer, "vocab", ex)
        self.layer = layer
        self.start, self.stop = ranges(layer.opts["vocab"], ex.parts, "vocab", layer.name)[ex.part]
        self._cache: tuple = ()
        self.takes_tokens = True

    def forward(self, p: dict, s: dict, x: Any, ctx: StepContext) -> Any:
        xp = K.get_array_module(x)
        idx = x.reshape(-1)
        if idx.dtype.kind not in "iu":
            raise self.layer._fail(f"wants integer token ids, got {idx.dtype}")
        mine = (idx >= self.start) & (idx < self.stop)
        local = xp.where(mine, idx - self.start, 0)
        rows = K.embedding_forward(local, p["W"])
        rows *= mine[:, None].astype(rows.dtype)  # ids of the other parts: zeros
        self._cache = (local, mine)
        return self.ex.sum(rows).reshape(*x.shape, self.layer.opts["dim"])

    def backward(self, dy: Any) -> tuple[Any, dict]:
        local, mine = self._cache
        d = dy.reshape(-1, self.layer.opts["dim"]) * mine[:, None].astype(dy.dtype)
        return None, {"W": K.embedding_backward(local, d, self.stop - self.start)}


class DimEmbedding(_Part):
    """Part ``ex.part`` of an embedding split by dimension: its columns of every id's row,
    concatenated over the parts; backward, its columns' gradient."""

    def __init__(self, layer: Embedding, ex: Exchange) -> None:
        super().__init__(layer, "dim", ex)
        self.layer = layer
        self.start, self.stop = ranges(layer.opts["dim"], ex.parts, "dims", layer.name)[ex.part]
        self._cache: tuple = ()
        self.takes_tokens = True

    def forward(self, p: dict, s: dict, x: Any, ctx: StepContext) -> Any:
        idx = x.reshape(-1)
        self._cache = (idx,)
        rows = K.embedding_forward(idx, p["W"])
        return self.ex.gather(rows, axis=1).reshape(*x.shape, self.layer.opts["dim"])

    def backward(self, dy: Any) -> tuple[Any, dict]:
        (idx,) = self._cache
        d = dy.reshape(-1, self.layer.opts["dim"])[:, self.start : self.stop]
        d = K.get_array_module(d).ascontiguousarray(d)
        return None, {"W": K.embedding_backward(idx, d, self.layer.opts["vocab"])}


def part_of(layer: Layer, by: str, ex: Exchange) -> Any:
    """The object that computes part ``ex.part`` of ``layer`` split ``by``."""
    if by not in SPLITS.get(layer.kind, ()):
        split(layer, by, {}, ex.parts)  # raises, naming the layer
    if layer.kind == "dense":
        assert isinstance(layer, Dense)
        return ColumnDense(layer, ex) if by == "columns" else RowDense(layer, ex)
    if layer.kind == "attention":
        assert isinstance(layer, Attention)
        return HeadAttention(layer, ex)
    assert isinstance(layer, Embedding)
    return VocabEmbedding(layer, ex) if by == "vocab" else DimEmbedding(layer, ex)


def part_net(net: Any, splits: dict[str, str], ex: Exchange) -> Any:
    """Part ``ex.part`` of ``net`` (a :class:`~.model.Net`) with the layers named in ``splits``
    split as it says (checked first, :func:`check_plan`): the same net, its split layers
    replaced by their parts, so that its ``loss_and_grads`` takes the part's parameters
    (:func:`split_params`) and gives the part's gradients. Every part computes the whole
    output, the same bits on each."""
    check_plan(net.layers, splits, ex.parts)
    out = copy.copy(net)
    out.layers = [
        part_of(ly, splits[ly.name], ex) if ly.name in splits else copy.copy(ly)
        for ly in net.layers
    ]
    return out


def split_params(net: Any, splits: dict[str, str], params: dict, parts: int) -> list[dict]:
    """The whole net's parameters (by full name) as each of ``parts`` holds them: its part of
    each split layer's, every other layer's whole."""
    out: list[dict] = [{} for _ in range(parts)]
    for ly in net.layers:
        local = {k: params[ly.key(k)] for k in ly.param_shapes()}
        shares = split(ly, splits[ly.name], local, parts) if ly.name in splits else [local] * parts
        for mine, share in zip(out, shares, strict=True):
            mine.update({ly.key(k): v for k, v in share.items()})
    return out


def join_params(net: Any, splits: dict[str, str], shares: Sequence[dict]) -> dict:
    """The whole net's parameters (or gradients) from the parts' (:func:`split_params`'
    inverse); a layer not split is part 0's."""
    out: dict = {}
    for ly in net.layers:
        names = list(ly.param_shapes())
        local = [{k: share[ly.key(k)] for k in names} for share in shares]
        whole = join(ly, splits[ly.name], local) if ly.name in splits else local[0]
        out.update({ly.key(k): v for k, v in whole.items()})
    return out


# Layers that may stand between the two halves of a split dense pair: element by element and
# without parameters, they compute on each part's columns what they would on the whole.
BETWEEN = ("relu", "sigmoid", "tanh", "gelu")


def check_plan(layers: Sequence[Layer], splits: dict[str, str], parts: int) -> None:
    """Refuse, naming the layer, a partitioning ``splits`` (layer name -> ``by``) of the net's
    ``layers`` into ``parts`` that cannot be computed: a kind that is not split, a ``by`` its
    kind does not have, sizes that do not divide, and a dense split by columns without a dense
    split by rows after it (only :data:`BETWEEN` layers between them), or one by rows without
    its columns before."""
    names = {la.name for la in layers}
    unknown = sorted(set(splits) - names)
    if unknown:
        raise ValueError(f"partitioning names no layer of the net: {', '.join(unknown)}")
    open_pair: Layer | None = None
    for la in layers:
        by = splits.get(la.name)
        if open_pair is not None and by is None and la.kind not in BETWEEN:
            raise ValueError(
                f"layer {open_pair.name!r} (dense split by columns): the next layer that is not "
                f"{'/'.join(BETWEEN)} must be a dense split by rows, its pair; got "
                f"{la.name!r} ({la.kind})"
            )
        if by is None:
            continue
        shapes = la.param_shapes()
        split(la, by, {k: np.empty(v, np.float32) for k, v in shapes.items()}, parts)
        if la.kind == "dense" and by == "rows":
            if open_pair is None:
                raise ValueError(
                    f"layer {la.name!r} (dense split by rows): needs a dense split by columns "
                    "before it, its pair"
                )
            open_pair = None
        elif la.kind == "dense":
            if open_pair is not None:
                raise ValueError(
                    f"layer {la.name!r} (dense split by columns): the layer before, "
                    f"{open_pair.name!r}, is split by columns too and has no pair"
                )
            open_pair = la
        elif open_pair is not None:
            raise ValueError(
                f"layer {open_pair.name!r} (dense split by columns): its pair must follow "
                f"before {la.name!r} ({la.kind}, split by {by})"
            )
    if open_pair is not None:
        raise ValueError(
            f"layer {open_pair.name!r} (dense split by columns): no dense split by rows after "
            "it, its pair"
        )
