"""Layer kinds and losses by name: raysinga's own, those a user registers from Python, and
those a job names by import path (``kind: mypkg.layers:RMSNorm``).

An import path is ``module:attribute`` (``module`` dotted, as ``import`` takes it). The module
is imported where the net is built: in the driver when the job is read, and in every role on
every node. A job ships its own modules to the nodes (the job's ``modules`` key,
``docs/layers.md``); a module that cannot be imported stops the run with one line naming it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from .kinds import LAYERS
from .layers import Layer
from .losses import CLASSIFYING, LOSSES

LossFn = Callable[[Any, Any, float], tuple[Any, Any]]

_layers: dict[str, type[Layer]] = {}  # registered from Python
_losses: dict[str, LossFn] = {}


class KindError(ValueError):
    """A layer kind or loss that names nothing usable; the message is one line."""


def register_layer(name: str, cls: type[Layer] | None = None) -> Any:
    """Make ``cls`` (a :class:`~raysinga.nn.Layer` subclass) a layer kind named ``name``.
    Usable as a decorator: ``@register_layer("rmsnorm")``. A name of raysinga's own, or one
    registered to another class, is refused. Every process that builds the net must run the
    registration: put it in a module the job names in ``modules``."""

    def add(c: type[Layer]) -> type[Layer]:
        _check_name(name, "layer kind")
        if name in LAYERS:
            raise KindError(f"layer kind {name!r} is raysinga's own; register yours as another")
        _check_layer_class(c, repr(name))
        if _layers.get(name, c) is not c:
            raise KindError(
                f"layer kind {name!r} is already registered to {_qualname(_layers[name])}"
            )
        _layers[name] = c
        return c

    return add if cls is None else add(cls)


def register_loss(name: str, fn: LossFn | None = None) -> Any:
    """Make ``fn(output, target, denom) -> (loss, d_loss/d_output)`` a loss named ``name``
    (the loss summed over the batch and divided by ``denom``, as raysinga's own). Usable as a
    decorator."""

    def add(f: LossFn) -> LossFn:
        _check_name(name, "loss")
        if name in LOSSES:
            raise KindError(f"loss {name!r} is raysinga's own; register yours as another")
        if not callable(f):
            raise KindError(f"loss {name!r}: {f!r} is not callable")
        if _losses.get(name, f) is not f:
            raise KindError(f"loss {name!r} is already registered to {_qualname(_losses[name])}")
        _losses[name] = f
        return f

    return add if fn is None else add(fn)


def layer_class(kind: str) -> type[Layer]:
    """The class of layer kind ``kind``: raysinga's own, registered, or an import path."""
    cls = _lookup(kind, "layer kind", LAYERS, _layers, "module:Class")
    _check_layer_class(cls, repr(kind))
    return cls


def loss_function(name: str) -> LossFn:
    """The loss ``name``: raysinga's own, registered, or an import path."""
    fn = _lookup(name, "loss", LOSSES, _losses, "module:function")
    if not callable(fn) or isinstance(fn, type):
        raise KindError(f"loss {name!r} is {_qualname(fn)}, not a function")
    return fn


def check_loss_options(name: str, fn: LossFn, given: dict[str, Any]) -> None:
    """Check the options a job gives loss ``name`` (``loss: {kind: name, option: value}``)
    against ``fn``'s signature, as a layer's are checked against its ``options``: they are the
    parameters after ``(output, target, denom)``, each without a default required. Raises
    KindError naming an unknown or missing option."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a callable Python cannot read the signature of
        params = []
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return  # it takes any option; its own code checks them when the job is read
    named = [p for p in params[3:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(given) - {p.name for p in named})
    if unknown:
        allowed = f"allowed: {sorted(p.name for p in named)}" if named else "it takes none"
        raise KindError(f"loss {name!r}: unknown option(s) {unknown}; {allowed}")
    missing = [p.name for p in named if p.default is p.empty and p.name not in given]
    if missing:
        raise KindError(f"loss {name!r}: missing option(s) {missing}")


def classifies(name: str, fn: LossFn) -> bool:
    """Whether loss ``name`` takes integer class labels and the argmax of the outputs' last
    axis is a prediction: raysinga's classifying losses, and a user's whose function says so
    (``fn.classifies = True``). Such a run reports accuracy."""
    return name in CLASSIFYING or bool(getattr(fn, "classifies", False))


def _lookup(name: Any, what: str, own: dict, registered: dict, path: str) -> Any:
    """What ``name`` names among raysinga's ``own``, the ``registered`` ones, or as an import
    path (``path`` shows its form); ``what``: "layer kind" or "loss", as a refusal says it."""
    noun = what.split()[0]
    if not isinstance(name, str) or not name:
        raise KindError(f"a {what} is a non-empty string, got {name!r}")
    if name in own:
        return own[name]
    if name in registered:
        return registered[name]
    if ":" not in name:
        known = ", ".join(sorted([*own, *registered]))
        raise KindError(
            f"unknown {what} {name!r}; allowed: {known}, or an import path '{path}' of a "
            f"{noun} of your own"
        )
    return _imported(name, noun)


def is_own(kind: str) -> bool:
    """Whether ``kind`` is one of raysinga's own layer kinds (tested with raysinga)."""
    return kind in LAYERS


def is_own_loss(name: str) -> bool:
    """Whether ``name`` is one of raysinga's own losses."""
    return name in LOSSES


def _imported(path: str, what: str) -> Any:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise KindError(f"{what} {path!r}: an import path is 'module:name'")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or module
        if module == missing or module.startswith(missing + "."):
            raise KindError(
                f"{what} {path!r}: module {missing!r} cannot be imported here; name the file or "
                "package in the job's `modules` (it is then on the path and shipped to every "
                "node)"
            ) from None
        raise KindError(  # the module is there; something it imports is not
            f"{what} {path!r}: importing module {module!r} failed: module {missing!r} is not "
            "installed here"
        ) from None
    except Exception as e:  # the module itself failed: say where
        raise KindError(
            f"{what} {path!r}: importing module {module!r} failed: {error_line(e)}"
        ) from None
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise KindError(f"{what} {path!r}: module {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def error_line(e: BaseException) -> str:
    """An error of the user's code in one line: its type and its message's first line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _check_layer_class(cls: Any, named: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Layer)):
        raise KindError(
            f"layer kind {named} is {_qualname(cls)}, not a layer (a subclass of raysinga.nn.Layer)"
        )


def _check_name(name: Any, what: str) -> None:
    if not isinstance(name, str) or not name or ":" in name:
        raise KindError(f"a registered {what} is a non-empty name without ':', got {name!r}")


def _qualname(obj: Any) -> str:
    if isinstance(obj, type) or callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
    shown = repr(obj)
    return f"the {type(obj).__name__} {shown if len(shown) <= 40 else shown[:37] + '...'}"
