"""The job's own Python modules (its ``modules`` key): the files and packages that its layers
and losses of the user's own come from (``docs/layers.md``). Each is a ``.py`` file (module
``stem``) or a package directory (module: the directory's name). This process imports them
from where they are; a run on Ray ships them to every node with the job
(:func:`raysinga.cluster.shipping.runtime_env`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any


def resolve(given: Any, base: Path) -> list[str]:
    """The absolute paths of ``given`` (a list of paths, relative to ``base``: the job file's
    directory), each checked, and their parent directories put on this process's path. A path
    that is not here passes where its module imports anyway (shipped to this node by Ray).
    Raises ValueError naming the entry (``modules[i]``) and what is wrong."""
    if given is None:
        return []
    if not isinstance(given, (list, tuple)) or not all(isinstance(p, str) for p in given):
        raise ValueError(f"modules: expected a list of paths, got {given!r}")
    paths, names = [], {}
    for i, entry in enumerate(given):
        p = _at(entry, base)
        where = f"modules[{i}]: {entry}"
        if p.is_file():
            if p.suffix != ".py":
                raise ValueError(f"{where}: not a Python file (.py) or package directory")
        elif p.is_dir():
            if not (p / "__init__.py").is_file():
                raise ValueError(f"{where}: a directory without __init__.py, not a package")
        elif importlib.util.find_spec(module_name(p)) is None:  # not shipped here either
            raise ValueError(f"{where}: no such file or directory (relative to {base})")
        name = module_name(p)
        if not name.isidentifier():
            raise ValueError(f"{where}: {name!r} cannot be imported by that name")
        if name in names:
            raise ValueError(f"{where}: module {name!r} is also modules[{names[name]}]")
        names[name] = i
        paths.append(str(p))
    on_path(paths)
    return paths


def on_path(paths: list[str]) -> None:
    """The directories of those of ``paths`` that are here, first on this process's path (a
    module shipped by Ray is importable without)."""
    for p in paths:
        parent = str(Path(p).parent)
        if Path(p).exists() and parent not in sys.path:
            sys.path.insert(0, parent)


def check_recorded(paths: list[str], spec: dict[str, Any]) -> None:
    """Raise ValueError in one line where a layer kind or the loss of ``spec`` (a recorded
    model spec) comes from a module of ``paths`` (the job's ``modules`` as recorded) whose file
    is no longer there and that this process cannot import otherwise."""
    named = [("layer kind", ly.get("kind")) for ly in spec.get("layers", [])]
    named.append(("loss", loss_kind(spec)))
    for p in paths:
        name = module_name(p)
        if Path(p).exists() or importlib.util.find_spec(name) is not None:
            continue
        for what, kind in named:
            if isinstance(kind, str) and kind.partition(":")[0].split(".")[0] == name:
                raise ValueError(
                    f"{what} {kind!r} comes from module {name!r}, recorded at {p}, which no "
                    "longer exists: put it back there, or where this process imports it from "
                    "(PYTHONPATH)"
                )


def absolute(given: Any, base: Path) -> Any:
    """``given`` (the job's ``modules``) with each relative path made absolute from ``base``:
    the job as recorded then names the same files from any working directory."""
    if not isinstance(given, list):
        return given
    return [str(_at(p, base)) if isinstance(p, str) else p for p in given]


def _at(entry: str, base: Path) -> Path:
    """The path ``entry`` names, relative to ``base`` where it is not absolute."""
    return (base / Path(entry).expanduser()).resolve()


def module_name(path: str | Path) -> str:
    """The name a module of the job's ``modules`` is imported by."""
    p = Path(path)
    return p.stem if p.suffix == ".py" else p.name


def inspect_line(run: dict[str, Any]) -> str:
    """The layer kinds and loss of a run's record (a checkpoint's ``run``) that are the user's
    own, with the modules its job named, as ``raysinga inspect`` shows them; empty where there
    are none."""
    from .registry import is_own, is_own_loss  # noqa: PLC0415

    spec = (run.get("model") or {}).get("spec") or {}
    kinds = [ly.get("kind") for ly in spec.get("layers", []) if not is_own(ly.get("kind"))]
    loss = loss_kind(spec)
    if loss and not is_own_loss(loss):
        kinds.append(loss)
    if not kinds:
        return ""
    modules = (run.get("config") or {}).get("modules") or []
    named = ", ".join(dict.fromkeys(str(k) for k in kinds))
    return named + (f" (modules: {', '.join(map(str, modules))})" if modules else "")


def loss_kind(spec: dict[str, Any]) -> Any:
    """The loss a recorded model spec names: its ``loss``, or that mapping's ``kind`` where the
    job gave the loss options."""
    loss = spec.get("loss")
    return loss.get("kind") if isinstance(loss, dict) else loss
