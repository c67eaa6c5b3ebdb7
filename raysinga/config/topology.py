"""Topology: how many servers, worker groups and workers per group, and what each role needs.

SINGA's cluster presets map onto it:

- ``sandblaster``: one synchronous group of ``workers_per_group`` workers and ``n_servers`` servers.
- ``downpour``: ``n_groups`` groups running asynchronously against shared servers.
- ``hogwild``: like Downpour with one worker per group and no staleness bound: every worker
  pushes updates on its own, lock-free at the granularity of a slice.
- ``allreduce``: one synchronous group whose servers sit on the workers' nodes (one server per
  worker), so updates travel over local shared memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

PRESETS = ("sandblaster", "downpour", "hogwild", "allreduce")


class TopologyError(ValueError):
    """Impossible topology numbers; the message names the key."""


@dataclass(frozen=True)
class Resources:
    """Ray resources of one actor. ``memory`` is in bytes (0: not reserved)."""

    cpus: float = 1.0
    gpus: float = 0.0
    memory: int = 0

    @property
    def empty(self) -> bool:
        return not (self.cpus or self.gpus or self.memory)

    def as_bundle(self) -> dict[str, float]:
        b = {"CPU": float(self.cpus)}
        if self.gpus:
            b["GPU"] = float(self.gpus)
        if self.memory:
            b["memory"] = float(self.memory)
        return b


@dataclass(frozen=True)
class Topology:
    preset: str = "sandblaster"
    n_servers: int = 1
    n_groups: int = 1
    workers_per_group: int = 1
    staleness: int | None = None  # max steps a group may run ahead of the slowest (None: any)
    slice_bytes: int = 4 << 20  # a parameter larger than this is cut into slices over servers
    worker: Resources = field(default_factory=Resources)
    # Servers and stubs work in short bursts between the workers' compute phases, so by default
    # they reserve nothing and ride in a worker's bundle (on its node): two workers and a server
    # fit a two-core machine. Give them CPUs of their own on bigger nodes.
    server: Resources = field(default_factory=lambda: Resources(cpus=0.0))
    stub: Resources = field(default_factory=lambda: Resources(cpus=0.0))

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise TopologyError(
                f"topology.preset: expected one of {', '.join(PRESETS)}, got {self.preset!r}"
            )
        for key in ("n_servers", "n_groups", "workers_per_group", "slice_bytes"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise TopologyError(f"topology.{key}: expected an integer >= 1, got {v!r}")
        if self.staleness is not None and (
            not isinstance(self.staleness, int) or self.staleness < 0
        ):
            raise TopologyError(
                f"topology.staleness: expected an integer >= 0 or null, got {self.staleness!r}"
            )
        if self.staleness is not None and self.preset != "downpour":
            raise TopologyError(
                f"topology.staleness: only the downpour preset bounds staleness ({self.preset}: "
                f"{'one synchronous group' if self.preset != 'hogwild' else 'no bound'}), "
                f"got {self.staleness!r}"
            )
        if self.preset in ("sandblaster", "allreduce") and self.n_groups != 1:
            raise TopologyError(
                f"topology.n_groups: the {self.preset} preset has exactly one "
                f"group, got {self.n_groups}"
            )
        if self.preset == "hogwild" and self.workers_per_group != 1:
            raise TopologyError(
                "topology.workers_per_group: the hogwild preset has one worker "
                f"per group, got {self.workers_per_group}"
            )
        if self.preset == "allreduce" and self.n_servers != self.workers_per_group:
            raise TopologyError(
                "topology.n_servers: the allreduce preset places one server "
                f"with each worker, so it must equal workers_per_group "
                f"({self.workers_per_group}), got {self.n_servers}"
            )
        if self.worker.empty:
            raise TopologyError("topology.worker: a worker must reserve some CPUs or GPUs")
        for role in ("worker", "server", "stub"):
            r = getattr(self, role)
            for key in ("cpus", "gpus", "memory"):
                v = getattr(r, key)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                    raise TopologyError(f"topology.{role}.{key}: expected a number >= 0, got {v!r}")
            if r.gpus > 1 and r.gpus % 1:
                raise TopologyError(
                    f"topology.{role}.gpus: a GPU count above 1 must be whole, got {r.gpus!r}"
                )

    @property
    def n_workers(self) -> int:
        return self.n_groups * self.workers_per_group

    @property
    def synchronous(self) -> bool:
        return self.n_groups == 1

    def total(self) -> dict[str, float]:
        """The resources the whole topology asks of the cluster."""
        out: dict[str, float] = {}
        for r, count in (
            (self.worker, self.n_workers),
            (self.server, self.n_servers),
            (self.stub, self.n_groups),
        ):
            for k, v in r.as_bundle().items():
                out[k] = out.get(k, 0.0) + v * count
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Topology:
        """From a job file's ``topology`` section; a preset fills in what is not given."""
        d = dict(d or {})
        allowed = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - allowed
        if unknown:
            raise TopologyError(
                f"topology: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}"
            )
        kw: dict[str, Any] = {}
        for role in ("worker", "server", "stub"):
            if role in d:
                r = d.pop(role)
                if not isinstance(r, dict) or set(r) - {"cpus", "gpus", "memory"}:
                    raise TopologyError(
                        f"topology.{role}: expected a mapping of cpus, gpus, memory, got {r!r}"
                    )
                # what the mapping leaves out keeps the role's default (a server given
                # only GPUs reserves no CPU, as a server given nothing)
                kw[role] = replace(cls.__dataclass_fields__[role].default_factory(), **r)
        if d.get("preset") == "allreduce" and "n_servers" not in d:
            d["n_servers"] = d.get("workers_per_group", 1)
        return cls(**d, **kw)
