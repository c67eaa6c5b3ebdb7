"""The calls that reach every role of a placement for checkpoints: verify and load one into
the servers and workers, take one (each server writes its own shard), and gather the state
and parameters a final result holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from raysinga.actors.common.errors import get_all
from raysinga.checkpoint import Checkpoint, CheckpointError
from raysinga.data.cursor import DataCursor
from raysinga.run import sources as run_sources
from raysinga.run.sources import Source
from raysinga.run.state import worker_state


class RoleCheckpoints:
    """:class:`.role_group.RoleGroup`'s checkpoint calls (its ``servers``, ``workers`` and
    ``plan``)."""

    servers: list[Any]
    workers: list[list[Any]]
    plan: Any
    # the run's heartbeat to these roles (silence.Watch) once they train, and where what it
    # hears is said: the checkpoints taken then wait listening to them
    watch: Any = None
    notice: Callable[[str], None] = print

    def _get(self, refs: list[Any], role: str, group: int | None = None) -> list[Any]:
        """:func:`~raysinga.actors.common.errors.get_all`, waiting as a chunk waits where the roles
        are watched: a host lost while they are asked for a checkpoint is noticed by the run
        itself (:class:`~.silence.Silent`), not after Ray's verdict, a minute later."""
        if self.watch is not None:
            self.watch.wait(refs, self.notice)
        return get_all(refs, role, group)

    # ------------------------------------------------------------------ checkpoints in
    def verify(self, src: Source, ck: Checkpoint) -> None:
        """Hash a checkpoint's files in full, the servers sharing the work."""
        files = [f["file"] for f in ck.manifest["files"]]
        plan = run_sources.plan_verification(files, len(self.servers))
        errors = get_all(
            [s.verify.remote(src, plan[k]) for k, s in enumerate(self.servers)], "server"
        )
        if any(errors):
            raise CheckpointError("; ".join(e for e in errors if e))

    def restore(self, start: Any, cursor: DataCursor, state_names: list[str]) -> None:
        """Load a verified start checkpoint into the servers (parameters; on a resume also the
        optimizer) and the workers (non-trainable state; on a resume also the data cursor)."""
        names = None if start.resumed else start.names
        fork = start.kind == "fork"  # the job's optimizer hyperparameters, not the checkpoint's
        get_all(
            [s.load.remote(start.source, start.resumed, names, fork) for s in self.servers],
            "server",
        )
        calls = []
        for g, row in enumerate(self.workers):
            for i, w in enumerate(row):
                st = worker_state(start.checkpoint, g, i, state_names)
                calls.append(w.restore.remote(st, cursor if start.resumed else DataCursor()))
        get_all(calls, "worker")

    # ------------------------------------------------------------------ checkpoints out
    def snapshot(self, tmp: Any, compression: str | None) -> tuple[list[dict], dict]:
        """Each server copies its shard at this step boundary and writes it in the background
        (their infos); each worker hands its non-trainable state ((group, index) -> arrays)."""
        infos = self._get(
            [s.snapshot.remote(tmp, k, compression) for k, s in enumerate(self.servers)],
            "server",
        )
        states = {}
        for g, row in enumerate(self.workers):
            for i, st in enumerate(self._get([w.get_state.remote() for w in row], "worker", g)):
                states[(g, i)] = st
        return infos, states

    def snapshot_results(self, servers: list[int], wait: bool) -> list[dict[str, Any] | None]:
        """The shard records of those servers' background writes (None: still writing)."""
        return self._get([self.servers[k].snapshot_result.remote(wait) for k in servers], "server")

    def gather_state(self) -> dict[str, np.ndarray]:
        """The non-trainable state (batch norm's running statistics) of group 0's first
        worker: the one a checkpoint of a single-process run would hold."""
        return self._get([self.workers[0][0].get_state.remote()], "worker", 0)[0]

    def gather_params(self) -> dict[str, np.ndarray]:
        """Whole parameters assembled from the servers' slices (small models, tests)."""
        values: dict[str, np.ndarray] = {}
        for vals in self._get([s.values.remote() for s in self.servers], "server"):
            values.update(vals)
        out = {}
        for p, shape in self.plan.shapes.items():
            pieces = sorted((s for s in self.plan.slices if s.param == p), key=lambda s: s.start)
            out[p] = np.concatenate([values[s.name] for s in pieces]).reshape(shape)
        return out
