"""A silent role noticed by the run itself, before Ray's verdict.

A machine that goes away does not close its sockets: its roles simply stop answering, and Ray
marks its node dead only once the node has missed its heartbeats for a while (about a minute
with Ray's defaults, measured on emulated hosts). A step waits on those roles all that time.
The run knows better: it sends every role a heartbeat (``alive``, answered in the role's
``control`` group, so a role busy with a step answers at once) while its groups run, and:

- a role that has not answered for ``fault.unreachable_s`` has its node looked at: a TCP
  connection to the node's raylet. A host that is up answers that from its kernel however
  busy its processes are; one that does not answer within as long is taken as lost, with every
  role on it;
- a role on a node that answers, silent for ``fault.silent_s`` and for ``fault.silent_steps``
  steps at the run's step time, is taken as lost alone (a process hung in a call).

Either way the roles are killed through Ray (their pending calls fail at once, and Ray ends
their processes when it next reaches them), replaced on other nodes, and fenced off by the
run's epoch (:mod:`raysinga.actors.exchange.fence`) in case they are heard from again. The
heartbeat's answer also carries how many messages a role refused from replaced ones, which the run
reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import ray

from raysinga.actors.common.errors import ActorLost
from raysinga.cluster.connect import host_answers

CONNECT_S = 0.25  # a host that is up answers a connection in far less (its kernel does)


class Role(NamedTuple):
    """One role the watch keeps an eye on."""

    actor: Any
    role: str
    index: int
    group: int | None
    node: str  # Ray's node id


class Silent(ActorLost):
    """Roles that stopped answering: ``roles`` (the first is the one named), and the nodes
    found unreachable (``nodes``, Ray's ids with their addresses)."""

    def __init__(self, roles: list[Role], nodes: dict[str, str], detail: str) -> None:
        first = roles[0]
        super().__init__(first.role, first.index, first.group, detail)
        self.roles, self.nodes = roles, nodes


class Watch:
    """The run's heartbeat to its roles while groups run (:meth:`check`, between waits)."""

    def __init__(self, fault: Any) -> None:
        self.unreachable_s = fault.unreachable_s
        self.silent_s, self.silent_steps = fault.silent_s, fault.silent_steps
        self.roles: list[Role] = []
        self.sent: dict[int, tuple[Any, float]] = {}  # role position -> (heartbeat ref, sent at)
        self.refused: dict[int, int] = {}  # role position -> messages it refused so far
        self.step_s = 0.0  # the run's step time, as measured
        self.addresses: dict[str, tuple[str, int]] = {}
        # nodes found unreachable (Ray's id -> address), which every placement of the run
        # avoids: Ray counts them alive until it gives them up
        self.unreachable: dict[str, str] = {}

    @property
    def poll_s(self) -> float:
        """How long the runner waits for a chunk before looking again."""
        return self.unreachable_s / 2

    def arm(self, roles: list[Role]) -> None:
        """Watch these roles from now on (after a launch or a replacement)."""
        self.roles = roles
        self.sent.clear()
        self.refused = {i: self.refused.get(i, 0) for i in range(len(roles))}
        self.addresses = {
            n["NodeID"]: (n["NodeManagerAddress"], int(n["NodeManagerPort"]))
            for n in ray.nodes()
            if n.get("Alive")
        }

    def taken_lost(self, e: Silent) -> str | None:
        """Silent roles: killed through Ray (calls waiting on them fail at once; Ray ends their
        processes when it reaches them again), their unreachable nodes avoided from now on.
        Returns the line that says so, where nodes were found unreachable."""
        for r in e.roles:
            ray.kill(r.actor)
        self.unreachable.update(e.nodes)
        if not e.nodes:
            return None
        return (
            f"raysinga: node(s) {', '.join(sorted(e.nodes.values()))} unreachable: "
            f"{len(e.roles)} role(s) there taken as lost, without waiting for Ray's verdict"
        )

    def forget_gone(self, alive: set[str]) -> None:
        """Nodes Ray has given up need no avoiding: only those still listed alive are kept."""
        for node in set(self.unreachable) - alive:
            del self.unreachable[node]

    def check(self) -> list[str]:
        """Send the heartbeat where none is on its way, take the answers in, and raise
        :class:`Silent` for roles that stopped answering; returns what roles newly report
        refusing (one line each)."""
        now = time.monotonic()
        news = self._answers()
        for i, role in enumerate(self.roles):
            if i not in self.sent:
                ref = role.actor.alive.options(concurrency_group="control").remote()
                self.sent[i] = (ref, now)
        # how long each heartbeat still on its way has been (a role's answer that came while
        # nobody looked was taken in above: a run busy elsewhere accuses no one)
        quiet = {i: now - t for i, (_, t) in self.sent.items()}
        suspects = [i for i, s in quiet.items() if s >= self.unreachable_s]
        if not suspects:
            return news
        down = {}
        for node in dict.fromkeys(self.roles[i].node for i in suspects):
            where = self.addresses.get(node)
            if where is not None and not host_answers(where, min(self.unreachable_s, CONNECT_S)):
                down[node] = where[0]
        if down:
            lost = [r for r in self.roles if r.node in down]
            hosts = ", ".join(sorted(down.values()))
            raise Silent(
                lost,
                down,
                f"silent: its node ({hosts}) did not answer for {max(quiet.values()):.1f} s "
                f"and its host does not answer a connection (steps take {self.step_s * 1e3:.0f} "
                "ms); taken as lost with every role on it",
            )
        limit = max(self.silent_s, self.silent_steps * self.step_s)
        hung = [self.roles[i] for i in suspects if quiet[i] >= limit]
        if hung:
            raise Silent(
                hung,
                {},
                f"silent: no answer for {limit:.1f} s ({self.silent_steps} steps of "
                f"{self.step_s * 1e3:.0f} ms) while its node answers; taken as lost",
            )
        return news

    def wait(self, refs: list[Any], notice: Callable[[str], None]) -> None:
        """Wait for calls to the roles made between chunks (a checkpoint's snapshots) as for a
        chunk: listening to the roles, so that a host lost then raises :class:`Silent` here
        too, not after Ray's verdict. Returns once every call has ended (well or not)."""
        pending = list(dict.fromkeys(refs))
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=self.poll_s)
            if pending:
                for line in self.check():
                    notice(line)

    def _answers(self) -> list[str]:
        refs = [ref for ref, _ in self.sent.values()]
        if not refs:
            return []
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done_ids = {r.hex() for r in done}
        news = []
        for i, (ref, _) in list(self.sent.items()):
            if ref.hex() not in done_ids:
                continue
            del self.sent[i]
            try:
                _, refused = ray.get(ref)
            except Exception:  # noqa: BLE001 - a dead role: the runner's wait reports it
                continue
            if refused > self.refused[i]:
                r = self.roles[i]
                g = f" of group {r.group}" if r.group is not None and r.role == "worker" else ""
                news.append(
                    f"raysinga: {r.role} {r.index}{g} refused {refused - self.refused[i]} "
                    "message(s) from roles replaced earlier (a partitioned host heard from "
                    "again); they were not applied"
                )
                self.refused[i] = refused
        return news
