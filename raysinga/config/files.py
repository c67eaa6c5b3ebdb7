"""Job files: YAML read strictly (a key given twice is refused, ``1e-3`` is a number), and
``--set key.path=value`` overrides applied before the job is validated (:func:`load`)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from raysinga.nn import usercode

from .job import JobConfig, from_dict
from .section import ConfigError


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` as a string; learning rates are written that way, so accept it.
    A key given twice in one mapping is refused: plain YAML lets the second silently win."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                key_node, yaml.ScalarNode
            ):
                continue  # `<<: *defaults` may be overridden, as YAML intends
            key = self.construct_object(key_node)
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first at {first[key].line + 1}:"
                    f"{first[key].column + 1})",
                    key_node.start_mark,
                )
            first[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _yaml_problem(e: yaml.YAMLError) -> str:
    """What the parser found, on one line."""
    what = [str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x]
    return "; ".join(what) or str(e).splitlines()[0]


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``["updater.lr=0.05", "train_steps=10"]`` applied to a copy of ``d``; values are YAML."""
    if overrides and not isinstance(d, dict):
        raise ConfigError(
            f"(top level): expected a mapping of keys, got {type(d).__name__} {d!r}; "
            f"--set {overrides[0]} has nowhere to go"
        )
    d = copy.deepcopy(d)
    for item in overrides:
        path, sep, text = item.partition("=")
        if not sep or not path:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        keys = path.split(".")
        node = d
        for i, k in enumerate(keys[:-1]):
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(keys[: i + 1])}: is not a mapping, cannot set {path}")
        try:
            node[keys[-1]] = parse_yaml(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: not a YAML value: {_yaml_problem(e)}") from None
    return d


def load(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Read and validate a YAML job file."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{path}: a directory, not a job file")
    if not p.is_file():
        raise ConfigError(f"{path}: no such job file")
    try:
        d = parse_yaml(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the job file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:  # one line: where, and what the parser found
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML: {_yaml_problem(e)}") from None
    d = apply_overrides(d or {}, overrides or [])
    if "modules" in d:  # recorded as absolute paths: a resume or a Tune trial finds them
        d["modules"] = usercode.absolute(d["modules"], p.resolve().parent)
    return from_dict(d, base=p.resolve().parent)
