"""How the job file's keys are declared, refused and documented.

Every section of a job is a :class:`Section`: a strict, frozen pydantic model whose fields carry
their type, default, bounds and description (:func:`key`). A job that does not fit is refused
with one line naming the key path and what was expected (:func:`explain`), and the key tables of
``docs/concepts.md`` are drawn from the same fields (:func:`key_table`).
"""

from __future__ import annotations

import types
import typing
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo


class ConfigError(ValueError):
    """A job file that cannot run; the message starts with the offending key path."""


class Refusal(ValueError):
    """A rule across a section's keys, raised inside the section: ``key`` (relative to the
    section, possibly empty) is what the message is about. Any exception with a ``key`` is
    read so (:class:`raysinga.data.kinds.SpecError`: the data package cannot import this)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class Section(BaseModel):
    """A part of the job file. Unknown keys are refused; an absent or empty section (``null``
    in YAML) takes every default."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # What a value of the section is, where "a mapping" would say too little.
    expected: ClassVar[str] = "a mapping"

    @model_validator(mode="before")
    @classmethod
    def _absent_is_empty(cls, data: Any) -> Any:
        return {} if data is None else data


def key(
    default: Any = ...,
    *,
    description: str,
    shown: str | None = None,
    expected: str | None = None,
    **rules: Any,
) -> Any:
    """A key of a section: its default, what it means, and its bounds (``ge``, ``le``, ...,
    as pydantic's ``Field`` takes them). ``shown``: how the docs show a default that is
    computed (``runs/<name>``); ``expected``: how a refusal says what a value must be, where
    the type and bounds say too little."""
    extra = {k: v for k, v in (("shown", shown), ("expected", expected)) if v is not None}
    if isinstance(default, type) and issubclass(default, BaseModel):  # a section: its defaults
        rules["default_factory"] = default
    elif "default_factory" not in rules:
        rules["default"] = default
    return Field(description=description, json_schema_extra=extra or None, **rules)


# ---------------------------------------------------------------- refusals


def explain(e: ValidationError, root: type[BaseModel], data: Any, at: tuple = ()) -> str:
    """The one line a job's refusal prints: the first of ``e``'s errors, naming its key path
    (``at`` + where in ``root``, which validated ``data``) and what was expected. Unknown keys
    come first (a misspelt key often explains a missing one), then missing keys, then values."""
    errors = e.errors(include_url=False)
    rank = {"extra_forbidden": 0, "missing": 1}
    first = min(range(len(errors)), key=lambda i: (rank.get(errors[i]["type"], 2), i))
    err = errors[first]
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = loc[:-1]
        model = _model_at(root, parent)
        where = path(at + parent)
        unknown = sorted(str(x["loc"][-1]) for x in errors if tuple(x["loc"][:-1]) == parent)
        allowed = ", ".join(model.model_fields) if model is not None else ""
        expected = getattr(model, "expected", "a mapping")
        if expected != "a mapping":
            try:
                return f"{where}: expected {expected}, got {_at(data, parent)!r}"
            except (KeyError, IndexError, TypeError):
                return f"{where}: expected {expected}, not the unknown key(s) {unknown}"
        if not at and not parent:
            return f"{unknown[0]}: unknown key; allowed: {allowed}"
        return f"{where}: unknown key(s) {unknown}; allowed: {allowed}"
    where = path(at + loc)
    if kind == "missing":
        info = _field_at(root, loc)
        about = f" ({info.description})" if info is not None and info.description else ""
        return f"{where}: missing{about}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        what = getattr(_model_at(root, loc), "expected", "a mapping")
        return f"{where}: expected {what}, got {type(err['input']).__name__} {err['input']!r}"
    error = (err.get("ctx") or {}).get("error")
    if isinstance(error, ConfigError):
        return str(error)  # a section's rule that names its own key path
    if isinstance(getattr(error, "key", None), str):  # a Refusal, or a section's own kind of it
        named = tuple(error.key.split(".")) if error.key else ()
        return f"{path(at + loc + named)}: {error}"
    if error is not None:
        return f"{where}: {error}"
    # A value inside a key's list or mapping is named by the key, with the key's whole value.
    field, _ = _walk(root, loc)
    value = err["input"]
    if field != loc:
        try:
            where, value = path(at + field), _at(data, field)
        except (KeyError, IndexError, TypeError):
            pass
    return f"{where}: expected {_expectation(root, field, kind)}, got {value!r}"


def path(loc: tuple) -> str:
    """``("model", "layers", 0, "units")`` -> ``model.layers[0].units``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _at(data: Any, loc: tuple) -> Any:
    for part in loc:
        data = data[part]
    return data


def _models(annotation: Any) -> list[Any]:
    """The types a field's annotation admits: ``X | None`` -> ``[X]``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _section_of(info: FieldInfo) -> type[BaseModel] | None:
    """The model a field holds, where it holds one (``checkpoint``: a section)."""
    found = [m for m in _models(info.annotation) if isinstance(m, type)]
    return next((m for m in found if issubclass(m, BaseModel)), None)


def _walk(root: type[BaseModel], loc: tuple) -> tuple[tuple, FieldInfo | None]:
    """The longest part of ``loc`` that names a key of a section, and that key's field:
    ``("init", "rename", "a")`` -> ``("init", "rename")``, ``rename`` being a mapping."""
    model: type[BaseModel] | None = root
    info = None
    for i, part in enumerate(loc):
        found = model.model_fields.get(str(part)) if model is not None else None
        if found is None:
            return loc[:i], info
        info, model = found, _section_of(found)
    return loc, info


def _field_at(root: type[BaseModel], loc: tuple) -> FieldInfo | None:
    named, info = _walk(root, loc)
    return info if named == loc else None


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    if not loc:
        return root
    info = _field_at(root, loc)
    return _section_of(info) if info is not None else None


def _expectation(root: type[BaseModel], loc: tuple, kind: str) -> str:
    """What a key's value must be, from its type and bounds: "an integer >= 1", "true or
    false", "one of float32, float64"."""
    info = _field_at(root, loc)
    if info is None:
        return "another value"
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    said = extra.get("expected")
    if said:
        return said
    kinds = _models(info.annotation)
    base = kinds[0] if kinds else info.annotation
    if typing.get_origin(base) is Literal:
        values = [str(v) for v in typing.get_args(base)]
        return "one of " + ", ".join(values)
    bounds = {
        name: getattr(m, name)
        for m in info.metadata
        if (name := type(m).__name__.lower()) in ("ge", "gt", "le", "lt")
    }
    noun = {bool: "true or false", int: "an integer", float: "a number", str: "text"}.get(
        base, "a value"
    )
    if base is bool:
        return noun
    if kind == "less_than_equal" and "le" in bounds:
        return f"{noun} <= {_number(bounds['le'])}"
    if kind == "less_than" and "lt" in bounds:
        return f"{noun} < {_number(bounds['lt'])}"
    for name, sign in (("ge", ">="), ("gt", ">")):
        if name in bounds:
            return f"{noun} {sign} {_number(bounds[name])}"
    if "le" in bounds:
        return f"{noun} <= {_number(bounds['le'])}"
    return "a non-empty text" if base is str else noun


def _number(v: Any) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


# ---------------------------------------------------------------- documentation


def key_table(model: type[BaseModel]) -> str:
    """The Markdown table of ``model``'s keys: key, default, meaning."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for name, info in model.model_fields.items():
        cells = [f"`{name}`", shown_default(info), info.description or ""]
        rows.append(" ".join(["|", " | ".join(cells), "|"]).replace("|  |", "| |"))
    return "\n".join(rows)


def shown_default(info: FieldInfo) -> str:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "shown" in extra:
        return str(extra["shown"])
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default_factory is not None else info.default
    return f"`{yaml_text(value)}`"


def yaml_text(value: Any) -> str:
    """``value`` as YAML's flow style writes it: ``true``, ``null``, ``{cpus: 1, gpus: 0}``."""
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    return str(value)
