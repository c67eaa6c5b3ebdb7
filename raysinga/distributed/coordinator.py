"""Checkpoints of a distributed run: begun at a step boundary, written by the servers in the
background while training goes on, committed by the driver once every shard is durable.

At most one checkpoint is in flight. Beginning the next one, a stop, a resize or the end of the
run first finishes the one before. A failed write removes its partial directory and raises; a
lost role leaves it to be abandoned once every role is stopped: nothing half-written is ever
committed.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ObjectLostError

from raysinga.actors.common.errors import ActorLost
from raysinga.checkpoint import CheckpointError, storage, writer
from raysinga.data.cursor import DataCursor
from raysinga.run.session import RunSession
from raysinga.run.state import merge_optimizer, run_meta, state_tensors

from .role_group import RoleGroup


@dataclass
class _Pending:
    """The checkpoint being written."""

    step: int
    steps: tuple[int, ...]
    replace: bool
    tmp: Any
    states: dict
    meta: dict[str, Any]
    records: list[dict[str, Any] | None]
    blocked: float  # seconds training waited at the step boundary
    t0: float


class CheckpointCoordinator:
    """Begin, commit and abandon the checkpoints of one run (the session books the commits)."""

    def __init__(self, session: RunSession) -> None:
        self.session = session
        self.pending: _Pending | None = None

    def begin(
        self,
        roles: RoleGroup,
        done: list[int],
        cursor: DataCursor,
        history: list[dict[str, Any]],
    ) -> None:
        """Snapshot every role at this step boundary and let the servers write in the
        background; the previous checkpoint, if still writing, is finished first."""
        self.finish(roles, wait=True)
        step, steps = max(done), tuple(done)
        replace = self.session.replaces(step, steps)
        if replace is None:
            return
        cfg, session = self.session.cfg, self.session
        t0 = time.perf_counter()
        tmp = session.staging(step, replace)
        try:
            infos, states = roles.snapshot(tmp, cfg.checkpoint.compression)
            optimizer = merge_optimizer([i["optimizer"] for i in infos])
        except BaseException:
            storage.remove_dir(tmp)
            raise
        meta = run_meta(
            cfg,
            done,
            cursor,
            optimizer,
            history,
            step,
            seed=session.start.seed,
            data=session.data,
        )
        self.pending = _Pending(
            step,
            steps,
            replace,
            tmp,
            states,
            meta,
            [None] * len(roles.servers),
            time.perf_counter() - t0,
            t0,
        )

    def finish(self, roles: RoleGroup, wait: bool) -> None:
        """Commit the checkpoint being written once every server's shard is durable (``wait``:
        block until then). A failed write removes the partial checkpoint and raises."""
        p = self.pending
        if p is None:
            return
        todo = [k for k, r in enumerate(p.records) if r is None]
        try:
            for k, r in zip(todo, roles.snapshot_results(todo, wait), strict=True):
                p.records[k] = r
            if any(r is None for r in p.records):
                return
            self.pending = None
            compression = self.session.cfg.checkpoint.compression
            state = writer.write_shard(
                p.tmp, len(roles.servers), state_tensors(p.states), compression
            )
            self.session.check_lock()
            path = writer.commit(p.tmp, p.step, [*p.records, state], p.meta, replace=p.replace)
        except (ActorLost, ObjectLostError):
            self.pending = p  # its directory goes once every role is stopped (recovery)
            raise
        except BaseException as e:
            self.pending = None
            for k in todo:  # let the other servers' writes end before the directory goes
                with contextlib.suppress(Exception):
                    roles.snapshot_results([k], True)
            storage.remove_dir(p.tmp)
            if isinstance(e, Exception):
                raise CheckpointError(
                    f"checkpoint of step {p.step} failed, nothing was committed: {e}"
                ) from e
            raise
        seconds = time.perf_counter() - p.t0
        # training waited at the step boundary, then in the next update for the servers' copy
        blocked = p.blocked + max(r.get("update_waited", 0.0) for r in p.records if r)
        self.session.committed(p.step, p.steps, str(path), blocked, seconds, in_background=True)

    def drop_if_lost(self, roles: RoleGroup, rebuilt: list[int]) -> None:
        """Servers ``rebuilt`` after a loss never write their shards of the checkpoint in
        flight: that checkpoint is dropped once the other servers' writes end (nothing of it
        was committed; the next one is whole)."""
        p = self.pending
        if p is None or all(p.records[k] is not None for k in rebuilt):
            return
        self.pending = None
        for k, r in enumerate(p.records):
            if r is None and k not in rebuilt:
                with contextlib.suppress(Exception):
                    roles.snapshot_results([k], True)
        storage.remove_dir(p.tmp)
        self.session.log(
            f"raysinga: the checkpoint of step {p.step} was dropped: server(s) "
            f"{', '.join(map(str, rebuilt))} were lost before writing their shards"
        )

    def abandon(self) -> None:
        """A checkpoint being written when the run failed is never committed: its directory
        goes once the servers are stopped (a write in flight ends with its server; a stray
        one is removed by the next prune)."""
        if self.pending is not None:
            p, self.pending = self.pending, None
            storage.remove_dir(p.tmp)
