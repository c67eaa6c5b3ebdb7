"""Checks of a job file beyond its shape: values a checkpoint could not store, data set specs
checked without opening a file, and sizes that cannot fit in memory, refused before anything is
allocated. Every error is a :class:`ConfigError` naming the key path."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from raysinga.nn.model import ModelSpec, Net

if TYPE_CHECKING:
    from .job import DataConfig
    from .topology import Topology


class ConfigError(ValueError):
    """A job file that cannot run; the message starts with the offending key path."""


def integer(path: str, v: Any, minimum: int, maximum: int | None = None) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ConfigError(f"{path}: expected an integer >= {minimum}, got {v!r}")
    if maximum is not None and v > maximum:
        raise ConfigError(f"{path}: expected an integer <= {maximum}, got {v!r}")
    return v


def flag(path: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{path}: expected true or false, got {v!r}")
    return v


def choice(path: str, v: Any, allowed: tuple[Any, ...]) -> Any:
    if v not in allowed:
        raise ConfigError(f"{path}: expected one of {', '.join(map(str, allowed))}, got {v!r}")
    return v


def storable(path: str, v: Any) -> None:
    """The job is stored in every checkpoint (msgpack): refuse at once what could not be stored
    there a run later, such as YAML's dates and integers beyond 64 bits."""
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ConfigError(f"{path or '(top level)'}: key {k!r} is not a name; quote it")
            storable(f"{path}.{k}" if path else k, x)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            storable(f"{path}[{i}]", x)
    elif isinstance(v, int) and not isinstance(v, bool):
        if not -(2**63) <= v <= 2**64 - 1:
            raise ConfigError(f"{path}: {v} does not fit in 64 bits")
    elif v is not None and not isinstance(v, (bool, float, str)):
        raise ConfigError(
            f"{path}: YAML read {v} as a {type(v).__name__}, which a job file cannot hold; "
            "quote it if you mean text"
        )


def mapping(path: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(v).__name__} {v!r}")
    return v


def section(name: str, d: Any, keys: dict[str, str]) -> dict[str, Any]:
    """An optional section of the job (absent: empty), refusing keys it does not know."""
    d = mapping(name, d or {})
    unknown = set(d) - set(keys)
    if unknown:
        raise ConfigError(f"{name}: unknown key(s) {sorted(unknown)}; allowed: {', '.join(keys)}")
    return d


# Value checks of data set spec keys (which keys a kind takes is raysinga.data's): integer keys
# -> their smallest and largest value (the teacher's bounds keep its labels exact), text keys.
_SOURCE_INTS = {
    "n": (1, 2**63 - 1),
    "dim": (1, 2**32),
    "hidden": (2, 2**20),
    "n_test": (1, 2**63 - 1),
    "seed": (0, 2**64 - 1),
    "cache_chunks": (1, None),
    "num_classes": (1, None),
}
_SOURCE_TEXT = ("x", "y", "path", "x_key", "y_key")


def _check_cache(where: str, spec: dict[str, Any]) -> None:
    """The block cache keys of a remote file (cache_dir, cache_bytes, block_bytes), as the
    worker will build them, so that a bad value fails before Ray starts."""
    from raysinga.data.cache import DEFAULT_BLOCK_BYTES, DEFAULT_CACHE_BYTES, CacheSpec  # noqa: PLC0415

    if not any(k in spec for k in ("cache_dir", "cache_bytes", "block_bytes")):
        return
    try:
        CacheSpec(
            spec.get("cache_dir"),
            spec.get("cache_bytes", DEFAULT_CACHE_BYTES),
            spec.get("block_bytes", DEFAULT_BLOCK_BYTES),
        )
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def check_source(spec: dict[str, Any]) -> dict[str, Any]:
    """A data set spec's kind, keys and value types, checked without opening any file (on a
    cluster the files may live only on the workers' nodes)."""
    from raysinga.data import kinds as data_mod  # noqa: PLC0415 - keeps config importable on its own

    kind = spec.get("kind")
    if kind not in data_mod.KINDS:
        what = "missing" if kind is None else f"unknown kind {kind!r}"
        raise ConfigError(f"data.source.kind: {what}; allowed: {', '.join(sorted(data_mod.KINDS))}")
    try:
        data_mod.check_keys(kind, spec, "data.source")
        test = spec.get("test")
        if test is not None:
            mapping("data.source.test", test)
            data_mod.check_keys(kind, {**spec, **test}, "data.source.test")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for where, part in (("data.source", spec), ("data.source.test", spec.get("test") or {})):
        for key, v in part.items():
            path = f"{where}.{key}"
            if key == "num_classes" and kind == "teacher":
                integer(path, v, 2)
            elif key in _SOURCE_INTS and not (key == "num_classes" and v is None):
                integer(path, v, *_SOURCE_INTS[key])
            elif key in _SOURCE_TEXT and (not isinstance(v, str) or not v):
                raise ConfigError(f"{path}: expected a file path or name, got {v!r}")
            elif key == "sample_shape" and (
                not isinstance(v, list)
                or not v
                or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in v)
            ):
                raise ConfigError(f"{path}: expected a list of positive integers, got {v!r}")
    if kind == "digits" and "test_fraction" in spec:
        f = spec["test_fraction"]
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1:
            raise ConfigError(f"data.source.test_fraction: expected a number in (0, 1), got {f!r}")
    for where, part in (("data.source", spec), ("data.source.test", spec.get("test") or {})):
        _check_cache(where, {**spec, **part})
    if kind == "teacher":
        noise = spec.get("noise", 0.0)
        if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0 <= noise <= 1:
            raise ConfigError(f"data.source.noise: expected a probability in [0, 1], got {noise!r}")
        n_test = spec.get("n_test", max(1, spec["n"] // 5))
        if spec["n"] + n_test >= 2**63:
            raise ConfigError(
                f"data.source.n: {spec['n']} training and {n_test} test samples (n_test) are "
                "more than the teacher can number (2**63)"
            )
    return spec


def _memory() -> tuple[int, str] | None:
    """This machine's memory in bytes, and how to name it (None where the system does not say)."""
    try:
        n = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return (n, f"this machine's memory ({n:,} bytes)") if n > 0 else None


def check_sizes(model: ModelSpec, data: DataConfig, dtype: str, topology: Topology | None) -> None:
    """Refuse what cannot fit in memory, from shapes alone, before anything is allocated: a layer
    whose parameters or whose output for one batch are larger than the machine, and a teacher
    data set whose weights and one batch of inputs are. A worker holds every parameter; on a
    cluster, ``topology.worker.memory`` (when larger) stands for the workers' nodes."""
    mem = _memory()
    if mem is None:
        return
    if topology is not None and topology.worker.memory > mem[0]:
        n = topology.worker.memory
        mem = (n, f"topology.worker.memory ({n:,} bytes)")
    most, what = mem
    item = 4 if dtype == "float32" else 8
    rows = data.batch_size  # a worker's share of it, in a distributed run
    if topology is not None:
        rows = -(-rows // topology.workers_per_group)
    sizes = Net(model, dtype).layer_sizes()
    for i, ((params, out), ls) in enumerate(zip(sizes, model.layers, strict=True)):
        where = f"model.layers[{i}] ({ls.name})"
        if params * item > most:
            raise ConfigError(
                f"{where}: its parameters take {params * item:,} bytes, more than {what}"
            )
        if rows * out * item > most:
            raise ConfigError(
                f"{where}: its output for one batch ({rows} rows of data.batch_size, {out:,} "
                f"values each) takes {rows * out * item:,} bytes, more than {what}"
            )
    total = sum(p for p, _ in sizes) * item
    if total > most:
        i = max(range(len(sizes)), key=lambda j: sizes[j][0])
        raise ConfigError(
            f"model.layers[{i}] ({model.layers[i].name}): the net's parameters take {total:,} "
            f"bytes in all, this layer {sizes[i][0] * item:,}; more than {what}"
        )
    src = data.source
    if src.get("kind") == "teacher":
        dim, hidden = src["dim"], src.get("hidden", 64)
        need = (dim * hidden + max(data.batch_size, data.eval_batch_size) * dim) * 8
        if need > most:
            raise ConfigError(
                f"data.source: the teacher's weights (dim {dim} x hidden {hidden}) and one batch "
                f"of its inputs take {need:,} bytes, more than {what}"
            )


def check_elastic(fault: Any, topology: Topology | None) -> None:
    """``fault.min_workers`` and ``min_groups`` against the topology they shrink."""
    for key, most, what in (
        ("min_workers", topology.workers_per_group if topology else None, "workers_per_group"),
        ("min_groups", topology.n_groups if topology else None, "n_groups"),
    ):
        v = getattr(fault, key)
        if v is None:
            continue
        if most is None:
            raise ConfigError(f"fault.{key}: only a distributed run (with a topology) is elastic")
        if v > most:
            raise ConfigError(f"fault.{key}: {v} is more than topology.{what} ({most})")
    if (
        topology is not None
        and topology.preset == "allreduce"
        and (fault.min_workers or topology.workers_per_group) < topology.workers_per_group
    ):
        raise ConfigError(
            "fault.min_workers: the allreduce preset keeps one server with each worker, so its "
            "workers cannot shrink"
        )
