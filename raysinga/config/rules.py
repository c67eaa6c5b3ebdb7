"""Rules across a job's sections, and what no section's types can say: a data source checked
against its kind's keys, values a checkpoint could not store, and sizes that cannot fit in
memory, refused before anything is allocated. Every refusal is a :class:`ConfigError` naming
the key path."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from raysinga.data import kinds
from raysinga.nn.model import ModelSpec, Net

from .section import ConfigError, explain, path

if TYPE_CHECKING:
    from .fault import FaultConfig
    from .topology import Topology


class DataConfig(Protocol):
    """What the rules read of a job's ``data`` section (:class:`.job.DataConfig`, whose module
    calls these rules and so is not imported here)."""

    source: dict[str, Any]
    batch_size: int
    eval_batch_size: int
    validation: Any  # a hold-out of the training split, or None


class JobConfig(Protocol):
    """What the rules read of a whole job (:class:`.job.JobConfig`)."""

    model: ModelSpec
    data: DataConfig
    topology: Topology | None
    fault: FaultConfig
    checkpoint: Any  # best_split, keep_best
    precision: Any  # compute
    device: str
    dtype: str

    @property
    def clip_norm(self) -> float | None: ...


def check_job(cfg: JobConfig) -> None:
    """The rules that tie one section's values to another's."""
    topology, data = cfg.topology, cfg.data
    if topology is not None and data.batch_size < topology.workers_per_group:
        raise ConfigError(
            f"data.batch_size: {data.batch_size} is smaller than "
            f"topology.workers_per_group ({topology.workers_per_group}): every "
            "worker needs at least one sample"
        )
    if cfg.checkpoint.best_split == "valid" and data.validation is None:
        raise ConfigError(
            f"checkpoint.keep_best: {cfg.checkpoint.keep_best} needs a validation split "
            "(data.validation: a fraction of the training split, e.g. 0.1)"
        )
    if cfg.device == "gpu" and topology is not None and not topology.worker.gpus:
        raise ConfigError(
            "device: gpu in a distributed run needs GPUs for the workers "
            "(topology.worker.gpus, e.g. 1 or 0.5)"
        )
    if cfg.precision.compute != "f32" and cfg.dtype != "float32":
        raise ConfigError(
            f"precision.compute: {cfg.precision.compute} rounds float32 operands and keeps "
            f"float32 master weights; dtype must be float32, got {cfg.dtype}"
        )
    if topology is not None and topology.reduce == "hosts":
        if cfg.clip_norm is not None:
            raise ConfigError(
                "updater.clip_norm: with topology.reduce: hosts no role sees the whole "
                "gradient to take its norm (each server sums its own slices); drop clip_norm "
                "or use reduce: stub"
            )
        if topology.wire.startswith("bf16") and cfg.dtype != "float32":
            raise ConfigError(
                f"topology.wire: {topology.wire} rounds float32 gradients and values; dtype "
                f"must be float32, got {cfg.dtype}"
            )
    check_elastic(cfg.fault, topology)
    check_sizes(cfg.model, data, cfg.dtype, topology)


def check_source(spec: dict[str, Any], where: tuple = ("data", "source")) -> None:
    """A data source's kind, keys and values, checked without opening a file (on a cluster
    the files may live only on the workers' nodes); a file source's ``test`` keys too."""
    kind = spec.get("kind")
    if kind not in kinds.SOURCES:
        what = "missing" if kind is None else f"unknown kind {kind!r}"
        allowed = ", ".join(sorted(kinds.SOURCES))
        raise ConfigError(f"{path((*where, 'kind'))}: {what}; allowed: {allowed}")
    model = kinds.SOURCES[kind]
    _check_form(model, kind, spec, where)
    if issubclass(model, kinds.FileSource) and spec.get("test") is not None:
        # after the spec itself (which checked that ``test`` is a mapping), so what fails here
        # is what its test keys change
        _check_form(model, kind, kinds.held_out_keys(spec), (*where, "test"))


def _check_form(model: Any, kind: str, form: dict[str, Any], at: tuple) -> None:
    try:
        model.model_validate(form)
    except ValidationError as e:
        missing = [x["loc"][0] for x in e.errors() if x["type"] == "missing"]
        if missing:
            raise ConfigError(
                f"{path(at)}: kind {kind!r} needs key(s) {missing}; got {sorted(form)}"
            ) from None
        raise ConfigError(explain(e, model, form, at=at)) from None


def storable(where: str, v: Any) -> None:
    """The job is stored in every checkpoint (msgpack): refuse at once what could not be stored
    there a run later, such as YAML's dates and integers beyond 64 bits."""
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ConfigError(f"{where or '(top level)'}: key {k!r} is not a name; quote it")
            storable(f"{where}.{k}" if where else k, x)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            storable(f"{where}[{i}]", x)
    elif isinstance(v, int) and not isinstance(v, bool):
        if not -(2**63) <= v <= 2**64 - 1:
            raise ConfigError(f"{where}: {v} does not fit in 64 bits")
    elif v is not None and not isinstance(v, (bool, float, str)):
        raise ConfigError(
            f"{where}: YAML read {v} as a {type(v).__name__}, which a job file cannot hold; "
            "quote it if you mean text"
        )


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


def check_elastic(fault: FaultConfig, topology: Topology | None) -> None:
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
