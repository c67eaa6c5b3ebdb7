"""The elastic decision: which topology a run takes on the cluster it finds.

A run asks for its configured topology. Where ``fault.min_groups`` / ``fault.min_workers``
allow smaller forms, it takes the largest one the live nodes hold (after a node loss, say), and
later grows back when room returns. This module decides; the role group places and spawns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raysinga.actors import placement


class Elastic:
    """The sizes a run may take, largest first, and the placement of the largest that fits."""

    def __init__(self, full: Any, fault: Any, log: Callable[[str], None], name: str = "") -> None:
        self.full, self.log, self.name = full, log, name  # name: the run's placement group
        self.avoid: dict[str, str] = {}  # nodes found unreachable (Ray's id -> address)
        self.sizes = placement.shrunk(
            full, fault.min_groups or full.n_groups, fault.min_workers or full.workers_per_group
        )

    @property
    def rigid(self) -> bool:
        return len(self.sizes) == 1

    def place(self) -> tuple[Any, placement.Placement]:
        """Reserve the configured topology, or where it does not fit (an elastic run) the
        largest smaller form: returns (topology, placement)."""
        if self.rigid:
            placement.check_fits(self.full)
            return self.full, placement.place(
                self.full, name=self.name, avoid=frozenset(self.avoid)
            )
        nodes = placement.live_nodes()
        fitting = [t for t in self.sizes if placement.packs(t, nodes)]
        if not fitting:
            placement.check_fits(self.sizes[-1])  # names what is missing
            fitting = self.sizes[-1:]  # the total fits, the nodes may not: let Ray say
        for i, t in enumerate(fitting):
            last = i + 1 == len(fitting)
            try:  # Ray has the last word: a node just lost may still be listed for a moment
                placed = placement.place(
                    t, timeout_s=30.0 if last else 10.0, name=self.name, avoid=frozenset(self.avoid)
                )
            except placement.ResourceError:
                if last:
                    raise
                continue
            if t != self.full:
                f = self.full
                self.log(
                    f"raysinga: room for {t.n_groups} group(s) x {t.workers_per_group} "
                    f"worker(s) of the configured {f.n_groups} x {f.workers_per_group}; "
                    "the batch is split over the workers there are"
                )
            return t, placed
        raise AssertionError("unreachable: the last size either placed or raised")

    def room_to_grow(self, running: Any) -> bool:
        """Whether the live nodes hold a larger topology than the one running."""
        nodes = placement.live_nodes()
        best = next((t for t in self.sizes if placement.packs(t, nodes)), None)
        return best is not None and best.n_workers > running.n_workers


def sizes_record(was: Any, now: Any) -> dict[str, Any]:
    """The sizes part of a failure or resize record: groups and workers now, and before where
    they changed."""
    out = {"groups": now.n_groups, "workers": now.workers_per_group}
    if (was.n_groups, was.workers_per_group) != (now.n_groups, now.workers_per_group):
        out["resized_from"] = {"groups": was.n_groups, "workers": was.workers_per_group}
    return out
