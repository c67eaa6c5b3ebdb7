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

from typing import Any, ClassVar, Literal

from pydantic import ValidationError, field_validator, model_validator

from .section import Refusal, Section, explain, key

PRESETS = ("sandblaster", "downpour", "hogwild", "allreduce")
REDUCES = ("stub", "hosts")
WIRES = ("f32", "bf16", "f32+zstd", "bf16+zstd", "f32+delta", "bf16+delta")
HOSTS_SLICE_BYTES = 16 << 10  # reduce: hosts's default slice_bytes


class TopologyError(ValueError):
    """Impossible topology numbers; the message names the key."""


class Resources(Section):
    """Ray resources of one role."""

    expected: ClassVar[str] = "a mapping of cpus, gpus, memory"

    cpus: float = key(1.0, ge=0, description="CPUs", expected="a number >= 0")
    gpus: float = key(
        0.0, ge=0, description="GPUs (a fraction shares one)", expected="a number >= 0"
    )
    memory: float = key(
        0, ge=0, description="bytes of memory (0: not reserved)", expected="a number >= 0"
    )

    @field_validator("gpus")
    @classmethod
    def _whole_above_one(cls, v: float) -> float:
        if v > 1 and v % 1:
            raise ValueError(f"a GPU count above 1 must be whole, got {v!r}")
        return v

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


# Servers and stubs work in short bursts between the workers' compute phases, so by default
# they reserve nothing and ride in a worker's bundle (on its node): two workers and a server fit
# a two-core machine. What a mapping for one leaves out keeps that default (a server given only
# GPUs reserves no CPU).
HELPER_CPUS = 0.0


def _helper() -> Resources:
    return Resources(cpus=HELPER_CPUS)


class Topology(Section):
    """Servers, groups, workers and their resources; absent or ``null`` in a job: one process,
    no Ray."""

    preset: Literal[PRESETS] = key(
        "sandblaster",
        description="`sandblaster`, `downpour`, `hogwild` or `allreduce` (next section)",
    )
    n_servers: int = key(
        1, ge=1, description="parameter servers (`allreduce`: `workers_per_group`)"
    )
    n_groups: int = key(
        1, ge=1, description="worker groups; more than 1 only for `downpour` and `hogwild`"
    )
    workers_per_group: int = key(
        1, ge=1, description="workers in each group (`hogwild`: exactly 1)"
    )
    staleness: int | None = key(
        None,
        ge=0,
        description="`downpour` only: how many steps a group may run ahead of the slowest; "
        "`null`: no bound",
        expected="an integer >= 0 or null",
    )
    slice_bytes: int = key(
        4 << 20,
        ge=1,
        description="a parameter larger than this is cut over the servers "
        "(`reduce: hosts`: 16 KiB by default)",
    )
    reduce: Literal[REDUCES] = key(
        "stub",
        description="how one synchronous group sums its gradients: `stub` (its stub sums every "
        "worker's) or `hosts` (the workers of each host are summed there, in shared memory, "
        "and the hosts' sums meet at the servers: per host a step moves what ring allreduce "
        "moves)",
    )
    workers_per_host: int = key(
        1,
        ge=1,
        description="`reduce: hosts`: the workers placed together on one host and summed there "
        "first (a block; the sum's order is fixed by it, wherever the blocks land)",
    )
    wire: Literal[WIRES] = key(
        "f32",
        description="`reduce: hosts`: what gradients and values cross between roles as: `f32`, "
        "or `bf16` (rounded to nearest even; the servers keep float32 values and state); "
        "`f32+zstd` and `bf16+zstd` send the same compressed without loss, for slow links; "
        "`f32+delta` and `bf16+delta` compress only the values' differences from the last "
        "ones sent, for links about as busy as the hosts' cores",
    )
    worker: Resources = key(
        Resources, description="Ray resources of each worker; must reserve some CPUs or GPUs"
    )
    server: Resources = key(default_factory=_helper, description="of each server")
    stub: Resources = key(default_factory=_helper, description="of each stub")

    @model_validator(mode="before")
    @classmethod
    def _preset_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {**data}
        for role in ("server", "stub"):
            if isinstance(data.get(role), dict):
                data[role] = {"cpus": HELPER_CPUS, **data[role]}
        if data.get("reduce") == "hosts" and "slice_bytes" not in data:
            # every parameter but the smallest cut over all servers: each host's share even
            data["slice_bytes"] = HOSTS_SLICE_BYTES
        if data.get("preset") == "allreduce" and "n_servers" not in data:
            per_host = data.get("workers_per_host", 1) if data.get("reduce") == "hosts" else 1
            w = data.get("workers_per_group", 1)
            blocks_fit = isinstance(w, int) and isinstance(per_host, int) and per_host > 0
            data["n_servers"] = w // per_host if blocks_fit and w % per_host == 0 else w
        return data

    @model_validator(mode="after")
    def _preset_rules(self) -> Topology:
        p = self.preset
        if self.staleness is not None and p != "downpour":
            what = "one synchronous group" if p != "hogwild" else "no bound"
            raise Refusal(
                "staleness",
                f"only the downpour preset bounds staleness ({p}: {what}), got {self.staleness!r}",
            )
        if p in ("sandblaster", "allreduce") and self.n_groups != 1:
            raise Refusal("n_groups", f"the {p} preset has exactly one group, got {self.n_groups}")
        if p == "hogwild" and self.workers_per_group != 1:
            raise Refusal(
                "workers_per_group",
                f"the hogwild preset has one worker per group, got {self.workers_per_group}",
            )
        self._reduce_rules()
        if p == "allreduce" and self.n_servers != self.n_blocks:
            what = "each worker" if self.reduce == "stub" else "each host's block of workers"
            raise Refusal(
                "n_servers",
                f"the allreduce preset places one server with {what}, so it must equal "
                f"{self.n_blocks}, got {self.n_servers}",
            )
        if self.worker.empty:
            raise Refusal("worker", "a worker must reserve some CPUs or GPUs")
        return self

    def _reduce_rules(self) -> None:
        if self.reduce == "stub":
            for k, default in (("workers_per_host", 1), ("wire", "f32")):
                if getattr(self, k) != default:
                    raise Refusal(
                        k, f"only with reduce: hosts, got {getattr(self, k)!r} (reduce: stub)"
                    )
            return
        if self.preset not in ("sandblaster", "allreduce"):
            raise Refusal(
                "reduce",
                "hosts: only one synchronous group (the sandblaster or allreduce preset) is "
                f"summed by hosts, got preset {self.preset}",
            )
        if self.workers_per_group % self.workers_per_host:
            raise Refusal(
                "workers_per_host",
                f"{self.workers_per_host} does not divide workers_per_group "
                f"({self.workers_per_group}): every host's block has as many workers",
            )

    @property
    def n_blocks(self) -> int:
        """The blocks of workers summed together (``reduce: hosts``; else one per worker)."""
        if self.reduce == "hosts":
            return self.workers_per_group // self.workers_per_host
        return self.workers_per_group

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

    def resized(self, n_groups: int, workers_per_group: int) -> Topology:
        """This topology with other counts (an elastic run's smaller or larger form)."""
        d = {**self.to_dict(), "n_groups": n_groups, "workers_per_group": workers_per_group}
        if self.reduce == "hosts" and workers_per_group % self.workers_per_host:
            d["workers_per_host"] = 1  # a shrunk group keeps its order only where blocks fit
        return Topology(**d)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Topology:
        """From a job file's ``topology`` section; a preset fills in what is not given."""
        try:
            return cls.model_validate(d or {})
        except ValidationError as e:
            raise TopologyError(explain(e, cls, d or {}, at=("topology",))) from None
