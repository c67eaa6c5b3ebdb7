"""The ``fault`` section of a job: what a run does about lost roles and nodes (how many losses
it takes, whether a lost role is replaced alone or every role restarts, the spares and copies
that make a replacement fast, the heartbeat that notices a silent one) and how small an
elastic run may go."""

from __future__ import annotations

from typing import Literal

from .section import Section, key


class FaultConfig(Section):
    max_failures: int = key(
        3,
        ge=0,
        description="recover from at most N lost roles or nodes, then stop with a summary (`0`: "
        "the first loss ends the run)",
    )
    window_s: float = key(
        0.0,
        ge=0,
        description="count only the failures of the last this many seconds (`0`: the whole run)",
        expected="a number of seconds >= 0",
    )
    min_workers: int | None = key(
        None,
        ge=1,
        shown="`topology.workers_per_group`",
        description="after a loss, go on with as few as this many workers per group where no "
        "more fit (by default never fewer)",
    )
    min_groups: int | None = key(
        None,
        ge=1,
        shown="`topology.n_groups`",
        description="after a loss, go on with as few as this many groups where no more fit",
    )
    grow_check_s: float = key(
        30.0,
        ge=0,
        description="while running smaller than configured, look this often for room to grow back",
        expected="a number of seconds >= 0",
    )
    recovery: Literal["replace", "restart"] = key(
        "replace",
        description="`replace`: a lost worker or stub is replaced alone and its group redoes the "
        "interrupted step, a lost server rebuilt from its copy; `restart`: every loss restarts "
        "every role from the newest checkpoint",
    )
    spares: bool = key(
        True,
        description="with `recovery: replace`, an idle spare worker, stub and server wait on "
        "each group's node and take a lost one's place at once; where a node has room and none "
        "of the run's roles (a standby), a spare worker and a spare of each server away from "
        "the stub wait there for a lost node's roles",
    )
    replay_steps: int = key(
        20,
        ge=0,
        description="with `recovery: replace`, log this many steps' summed gradients (each "
        "group's stub) and keep a copy of each server every half of them, to rebuild a lost "
        "server (`0`: restart instead)",
    )
    replay_mb: int = key(
        256, ge=1, description="at most this many MiB of logged gradients per group"
    )
    unreachable_s: float = key(
        0.5,
        gt=0,
        description="a role that has not answered the run's heartbeat for this long has its node "
        "looked at: a node whose host does not answer a connection within as long is taken "
        "as lost, with all its roles, without waiting for Ray's verdict",
        expected="a number of seconds > 0",
    )
    silent_s: float = key(
        10.0,
        gt=0,
        description="a role on a reachable node that has not answered the heartbeat for this "
        "long, and for `silent_steps` steps, is taken as lost",
        expected="a number of seconds > 0",
    )
    silent_steps: int = key(
        100, ge=1, description="see `silent_s`: the steps (at the run's step time) a role may miss"
    )
