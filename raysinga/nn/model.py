"""The model spec (a net of named layers) and the net that computes loss and gradients with it.

A :class:`ModelSpec` is plain data: it crosses actor boundaries, goes into job files and
checkpoints, and hashes to a stable digest. :class:`Net` builds layers from it; parameters get
stable hierarchical names (``fc1/W``, ``fc1/b``) and are passed in as a flat dict, never owned.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raysinga import kernels as K

from . import usercode
from .checks import check_declared, described
from .layers import Layer, RowsHook, StepContext, param_rng
from .losses import accuracy
from .registry import (
    KindError,
    check_loss_options,
    classifies,
    error_line,
    is_own,
    is_own_loss,
    layer_class,
    loss_function,
)

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@dataclass(frozen=True)
class LayerSpec:
    kind: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, **self.options}


@dataclass(frozen=True)
class ModelSpec:
    input_shape: tuple[int, ...]
    layers: tuple[LayerSpec, ...]
    loss: str = "softmax_cross_entropy"
    loss_options: dict[str, Any] = field(default_factory=dict)  # a user's loss's, from the job

    @classmethod
    def from_dict(cls, d: dict[str, Any], probe: bool = True) -> ModelSpec:
        """From a job file's ``model`` section; errors name the offending key path.
        ``probe``: as :meth:`validate`'s."""
        if not isinstance(d, dict):
            raise ValueError(f"model: expected a mapping, got {type(d).__name__}")
        unknown = set(d) - {"input_shape", "layers", "loss"}
        if unknown:
            raise ValueError(
                f"model: unknown key(s) {sorted(unknown)}; allowed: input_shape, layers, loss"
            )
        for key in ("input_shape", "layers"):
            if key not in d:
                raise ValueError(f"model.{key}: missing")
        shape = d["input_shape"]
        if (
            not isinstance(shape, (list, tuple))
            or not shape
            or not all(isinstance(v, int) and v > 0 for v in shape)
        ):
            raise ValueError(
                f"model.input_shape: expected a list of positive integers, got {shape!r}"
            )
        if not isinstance(d["layers"], list) or not d["layers"]:
            raise ValueError("model.layers: expected a non-empty list of layers")
        layers = []
        for i, ld in enumerate(d["layers"]):
            if not isinstance(ld, dict) or "kind" not in ld or "name" not in ld:
                raise ValueError(f"model.layers[{i}]: expected a mapping with 'kind' and 'name'")
            opts = {k: v for k, v in ld.items() if k not in ("kind", "name")}
            layers.append(LayerSpec(ld["kind"], ld["name"], opts))
        loss, loss_options = _loss_of(d.get("loss", "softmax_cross_entropy"))
        spec = cls(tuple(shape), tuple(layers), loss, loss_options)
        spec.validate(probe)
        return spec

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_shape": list(self.input_shape),
            "layers": [ls.to_dict() for ls in self.layers],
            # the plain name where there are no options: a spec's digest as it always was
            "loss": {"kind": self.loss, **self.loss_options} if self.loss_options else self.loss,
        }

    def digest(self) -> str:
        """SHA-256 of the canonical JSON form: equal specs, equal digests, across processes."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def validate(self, probe: bool = True) -> None:
        """Build every layer once so bad options fail when the config is read; with ``probe``,
        a layer or loss of the user's own also runs once on a small batch
        (:func:`.checks.probe`), so that a forward or backward that breaks its declared shapes
        fails here, not in a role. A role rebuilding the spec the driver checked skips that."""
        net = Net(self)
        if probe:
            from .checks import probe as run_once  # noqa: PLC0415

            run_once(net)

    def own_kinds(self) -> list[str]:
        """The layer kinds and loss of the user's own (import paths or registered names)."""
        kinds = [ls.kind for ls in self.layers if not is_own(ls.kind)]
        if not is_own_loss(self.loss):
            kinds.append(self.loss)
        return list(dict.fromkeys(kinds))


def _loss_of(given: Any) -> tuple[Any, dict[str, Any]]:
    """A job's ``model.loss``, a name or ``{kind: name, option: value, ...}``: the name and the
    options."""
    if not isinstance(given, dict):
        return given, {}
    if "kind" not in given:
        raise ValueError(
            f"model.loss: a mapping names its loss as 'kind' beside its options, got {given!r}"
        )
    return given["kind"], {k: v for k, v in given.items() if k != "kind"}


def recorded_spec(run: dict[str, Any], where: str) -> ModelSpec:
    """The model spec of a run's record (a checkpoint's ``run``: ``run["model"]["spec"]``),
    with the modules its job named (``modules``, :mod:`.usercode`) put on the path where they
    are still there. A spec that cannot be built (a layer's module gone) raises ValueError in
    one line naming ``where`` (the checkpoint)."""
    modules = list((run.get("config") or {}).get("modules") or [])
    usercode.on_path(modules)
    spec = run["model"]["spec"]
    try:
        usercode.check_recorded(modules, spec)
        return ModelSpec.from_dict(spec)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


class Net:
    """Layers built from a spec, with the loss at the end."""

    def __init__(self, spec: ModelSpec, dtype: str = "float32", dw_row_blocks: int = 1) -> None:
        """``dw_row_blocks``: the blocks of rows a large dense weight's gradient is computed in
        (:func:`.layers.dw_row_blocks`: more than one in a job summed by hosts)."""
        if dtype not in K.common.FLOAT_DTYPES:
            raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")
        try:
            fn = loss_function(spec.loss)
            check_loss_options(spec.loss, fn, spec.loss_options)
        except KindError as e:
            raise ValueError(f"model.loss: {e}") from None
        self.loss_fn = functools.partial(fn, **spec.loss_options) if spec.loss_options else fn
        self.classifies = classifies(spec.loss, fn)  # the run reports accuracy
        self.spec, self.dtype = spec, np.dtype(dtype)
        self.layers: list[Layer] = []
        self.out_shapes: list[tuple[int, ...]] = []  # per layer, one sample's
        # per layer, the earlier layers whose outputs it sums (its ``from``); None: the last one
        self.sources: list[tuple[str, ...] | None] = []
        names: dict[str, int] = {}
        shape = tuple(spec.input_shape)
        for i, ls in enumerate(spec.layers):
            try:
                cls = layer_class(ls.kind)
            except KindError as e:
                raise ValueError(f"model.layers[{i}].kind: {e}") from None
            if not ls.name or not set(ls.name) <= _NAME_CHARS or ls.name in names:
                raise ValueError(
                    f"model.layers[{i}].name: {ls.name!r} must be unique and use only letters, "
                    "digits, '_', '-' and '.'"
                )
            options = dict(ls.options)
            sources = self._sources(i, ls.name, options.pop("from", None), names)
            if sources is not None:
                shape = self.out_shapes[names[sources[0]]]
            names[ls.name] = i
            try:
                layer = cls(ls.name, **options)
                layer.kind = ls.kind  # as the job names it (a class of the user's may not say)
                shape = layer.build(shape)
                check_declared(layer, shape)
            except TypeError as e:  # an option the layer does not take
                raise ValueError(f"model.layers[{i}] ({ls.name}): {e}") from None
            except ValueError as e:
                raise ValueError(f"model.layers[{i}]: {e}") from None
            layer.dw_row_blocks = dw_row_blocks
            self.layers.append(layer)
            self.out_shapes.append(tuple(shape))
            self.sources.append(sources)
        self.layers[0].need_dx = False  # nobody wants the input's gradient: skip that GEMM
        self._check_used()
        self.output_shape = shape
        self.takes_tokens = bool(getattr(self.layers[0], "takes_tokens", False))
        # outputs a later layer's ``from`` names: kept during a forward pass
        self.kept = {n for srcs in self.sources if srcs for n in srcs}

    def _sources(
        self, i: int, name: str, given: Any, names: dict[str, int]
    ) -> tuple[str, ...] | None:
        """A layer's ``from``: earlier layers of one output shape, whose outputs it sums."""
        if given is None:
            return None
        where = f"model.layers[{i}] ({name}).from"
        if isinstance(given, str):
            given = [given]
        if not isinstance(given, list) or not given or not all(isinstance(n, str) for n in given):
            raise ValueError(f"{where}: expected a list of earlier layers' names, got {given!r}")
        unknown = [n for n in given if n not in names]
        if unknown:
            raise ValueError(
                f"{where}: {unknown} name no earlier layer; a layer can sum the outputs of "
                f"layers above it ({', '.join(names) or 'none'})"
            )
        shapes = {n: self.out_shapes[names[n]] for n in given}
        if len(set(shapes.values())) > 1:
            raise ValueError(f"{where}: outputs of different shapes cannot be summed: {shapes}")
        return tuple(given)

    def _check_used(self) -> None:
        """Every layer's output goes somewhere: the next layer, a ``from``, or the loss."""
        used = {n for srcs in self.sources if srcs for n in srcs}
        for i, ly in enumerate(self.layers[:-1]):
            if self.sources[i + 1] is not None and ly.name not in used:
                raise ValueError(
                    f"model.layers[{i}] ({ly.name}): its output is used by no later layer "
                    f"(layer {self.layers[i + 1].name!r} takes 'from' instead)"
                )

    def prepare_input(self, x: Any, xp: Any = np) -> Any:
        """A batch as the first layer takes it: token ids as they are (integers), anything
        else in the net's dtype."""
        if self.takes_tokens:
            return xp.asarray(x)
        return xp.asarray(x, self.dtype)

    # -- names, shapes, initial values
    def describe(self) -> dict[str, Any]:
        """The net's structure as plain data: every layer with its options, the shape of one
        sample leaving it and its parameters (what ``raysinga graph`` draws)."""
        layers = []
        for ly, ls, out in zip(self.layers, self.spec.layers, self.out_shapes, strict=True):
            params = {ly.key(k): list(s) for k, s in ly.param_shapes().items()}
            layers.append(
                {
                    "name": ly.name,
                    "kind": ls.kind,
                    "options": dict(ls.options),
                    "output_shape": list(out),
                    "params": params,
                    "param_count": sum(int(np.prod(s)) for s in params.values()),
                }
            )
        return {
            "input_shape": list(self.spec.input_shape),
            "layers": layers,
            "loss": self.spec.loss,
            "param_count": sum(ly["param_count"] for ly in layers),
        }

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trainable parameter, in layer order: ``{"fc1/W": (784, 1024), ...}``."""
        return {ly.key(k): s for ly in self.layers for k, s in ly.param_shapes().items()}

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Non-trainable state (batch-norm running statistics)."""
        return {ly.key(k): s for ly in self.layers for k, s in ly.state_shapes().items()}

    def layer_sizes(self) -> list[tuple[int, int]]:
        """Per layer, from shapes alone (nothing is allocated): the elements of its parameters
        and state, and the elements of one sample leaving it."""
        sizes = []
        for ly, out in zip(self.layers, self.out_shapes, strict=True):
            shapes = (*ly.param_shapes().values(), *ly.state_shapes().values())
            sizes.append((sum(math.prod(s) for s in shapes), math.prod(out)))
        return sizes

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        """Initial parameters as NumPy arrays; each depends only on (seed, its name)."""
        return {key: self.init_param(key, seed) for key in self.param_shapes()}

    def init_param(self, key: str, seed: int) -> np.ndarray:
        """The initial value of one parameter, so that a server creates only what it owns."""
        layer_name, _, local = key.rpartition("/")
        for ly in self.layers:
            if ly.name == layer_name and local in ly.param_shapes():
                shape = ly.param_shapes()[local]
                return np.asarray(ly.init_param(local, shape, param_rng(seed, key)), self.dtype)
        raise KeyError(f"no parameter {key!r} in this model")

    def init_state(self) -> dict[str, np.ndarray]:
        return {
            ly.key(k): np.asarray(ly.init_state(k, s), self.dtype)
            for ly in self.layers
            for k, s in ly.state_shapes().items()
        }

    # -- compute
    def forward(self, params: dict, state: dict, x: Any, ctx: StepContext) -> Any:
        kept: dict[str, Any] = {}
        n = len(x)
        for i, (ly, sources) in enumerate(zip(self.layers, self.sources, strict=True)):
            given = x  # the previous layer's output
            try:
                if sources is not None:
                    x = kept[sources[0]]
                    for name in sources[1:]:
                        x = x + kept[name]
                local = {k: params[ly.key(k)] for k in ly.param_shapes()}
                x = ly.forward(local, state, x, ctx)
            except Exception as e:
                failed = self._forward_failed(i, n, given, kept, e)
                if failed is None:
                    raise
                raise failed from e
            if ly.name in self.kept:
                kept[ly.name] = x
        return x

    def _forward_failed(
        self, i: int, n: int, given: Any, kept: dict[str, Any], e: Exception
    ) -> ValueError | None:
        """The error of layer ``i`` that failed on a batch of ``n``, in one line naming it and
        the layers its input came from, with what each gave against what it declares: a layer
        that passed the job's check on two samples can break its shapes on a real batch, and
        the layer it feeds is the one that fails. None where the error is not about the
        input (raysinga's own layer, fed by raysinga's own, raising other than ValueError)."""
        names = [ly.name for ly in self.layers]
        feeding = [names.index(s) for s in self.sources[i]] if self.sources[i] else [i - 1]
        feeding = [j for j in feeding if j >= 0]
        ours = all(is_own(self.spec.layers[j].kind) for j in [i, *feeding])
        if ours and not isinstance(e, ValueError):
            return None
        lines = str(e).strip().splitlines()
        why = lines[0] if isinstance(e, ValueError) and lines else error_line(e)
        came = []
        for j in feeding:
            out = kept.get(names[j], given) if self.sources[i] else given
            declared = self.out_shapes[j]
            mark = (
                ""
                if getattr(out, "shape", None) == (n, *declared)
                else f" where it declares {declared} per sample"
            )
            came.append(f"{self._named(j)}, which gave {described(out)}{mark}")
        source = " and ".join(came) if came else f"the batch, {described(given)}"
        return ValueError(
            f"{self._named(i)} failed on a batch of {n}: {why}; its input came from {source}"
        )

    def _named(self, i: int) -> str:
        return f"model.layers[{i}] ({self.spec.layers[i].name}, {self.spec.layers[i].kind})"

    def backward(
        self,
        dout: Any,
        into: dict[str, Any] | None = None,
        on_grads: Callable[[dict[str, Any]], None] | None = None,
        on_ready: Callable[[dict[str, Any]], None] | None = None,
        on_rows: RowsHook | None = None,
    ) -> dict[str, Any]:
        """The parameters' gradients. ``into`` (parameter name -> an array of its shape and
        dtype): where layers that can write their gradients do so (a worker's shared buffer);
        the others' come back as new arrays. ``on_grads``: called with each layer's
        gradients (by parameter name) as soon as that layer is done, its dx too, the last
        layer first (a worker sends them on while the layers before it are computed; a
        server may then update those parameters in place, which no layer before reads).
        ``on_ready``: called before that, with the gradients of a layer that can hand them
        over final before it computes its dx (a dense layer), which still reads the layer's
        parameters: what may go where no reader of those parameters is disturbed.
        ``on_rows``: told, where a layer writes into ``into`` a gradient it computes by blocks
        of rows (a dense layer's weight), of each block as it is final; and asked which block
        to compute first."""
        grads: dict[str, Any] = {}
        # the gradient with respect to each layer's output, summed over where it went
        pending: dict[str, Any] = {self.layers[-1].name: dout}
        for i in reversed(range(len(self.layers))):
            ly, sources = self.layers[i], self.sources[i]
            if into:
                ly.grads_into = {k: into[ly.key(k)] for k in ly.param_shapes()}
            if on_ready is not None:
                ly.grads_ready = _keyed(ly, on_ready)
            ly.rows_hook = on_rows if into else None
            try:
                dx, g = ly.backward(pending.pop(ly.name))
            finally:
                ly.grads_into, ly.grads_ready, ly.rows_hook = {}, None, None
            mine = {ly.key(k): v for k, v in g.items()}
            grads.update(mine)
            if on_grads is not None and mine:
                on_grads(mine)
            if i == 0:
                break
            for name in sources if sources is not None else (self.layers[i - 1].name,):
                pending[name] = dx if name not in pending else pending[name] + dx
        return {k: grads[k] for k in self.param_shapes()}

    def loss_and_grads(
        self,
        params: dict,
        state: dict,
        x: Any,
        y: Any,
        ctx: StepContext,
        denom: int | None = None,
        into: dict[str, Any] | None = None,
        on_device: bool = False,
        on_grads: Callable[[dict[str, Any]], None] | None = None,
        on_ready: Callable[[dict[str, Any]], None] | None = None,
        on_rows: RowsHook | None = None,
    ) -> tuple[Any, dict[str, Any], Any]:
        """``(loss, grads, output)``; the loss is summed over the batch and divided by ``denom``
        (default: the batch size). A worker of a group passes the group's batch size, so that the
        group's gradient is the plain sum of its workers' gradients. ``into``, ``on_grads``,
        ``on_ready`` and ``on_rows``: see :meth:`backward`. The loss is a float, or with
        ``on_device`` the 0-d array where it was computed (nothing waits for the GPU: a step
        recorded as a CUDA graph needs that)."""
        out = self.forward(params, state, x, ctx)
        loss, dout = self.loss_fn(out, y, len(x) if denom is None else denom)
        grads = self.backward(dout, into, on_grads, on_ready, on_rows)
        return (loss if on_device else float(loss)), grads, out

    def evaluate(self, params: dict, state: dict, x: Any, y: Any) -> tuple[float, float | None]:
        """``(mean loss, accuracy or None)`` on one batch in inference mode."""
        out = self.forward(params, state, x, StepContext(train=False))
        loss, _ = self.loss_fn(out, y, len(x))
        acc = accuracy(out, y) if self.classifies else None
        return float(loss), acc


def _keyed(ly: Any, fn: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """``fn`` of layer ``ly``'s gradients by their local names, called by parameter name."""
    return lambda g: fn({ly.key(k): v for k, v in g.items()})
