"""The bytes one step of a group moves between nodes, by route, counted from what its roles
hand one another and where each one runs.

A step through Ray calls (the roles of a group on more than one node) moves three things:

- each worker on another node than its stub returns a snapshot of its gradient buffer to the
  stub (the worker's node sends it, the stub's receives it);
- the stub sends each server on another node that server's slices of the summed gradient;
- each server with a reader on another node publishes its values into its node's object store
  after its update, and each other node whose workers read them pulls them once: Ray's object
  manager fetches an object to a node once, however many of the node's workers read it.

Where the whole group shares one node (doorbells, shared memory), a step moves nothing between
nodes. What a step sends beside these (the calls themselves, their small results, Ray's own
control traffic) is not counted: the emulated hosts' interface counters measure how far that
goes (``tests/cluster/test_traffic_hosts.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

Route = tuple[str, str]  # (the node that sends, the node that receives)


def group_step_bytes(
    stub: str,
    workers: Sequence[str],
    snapshots: Sequence[int],
    servers: Sequence[str],
    updates: Sequence[int],
    published: Sequence[int],
) -> dict[Route, int]:
    """The bytes of one step by route: ``workers``/``servers`` are the roles' nodes,
    ``snapshots[i]`` the bytes worker ``i`` returned (0 where it returned none, on the stub's
    node), ``updates[k]`` the bytes the stub sent server ``k`` (0 on the stub's node) and
    ``published[k]`` the size of server ``k``'s published values (0 where it publishes
    none)."""
    moved: Counter[Route] = Counter()
    for node, n in zip(workers, snapshots, strict=True):
        if n and node != stub:
            moved[(node, stub)] += n
    for node, n in zip(servers, updates, strict=True):
        if n and node != stub:
            moved[(stub, node)] += n
    _values_back(moved, workers, servers, published)
    return dict(moved)


def block_step_bytes(
    workers: Sequence[str],
    blocks: Sequence[Sequence[int]],
    snapshots: Sequence[int],
    servers: Sequence[str],
    sent: Sequence[Sequence[int]],
    published: Sequence[int],
) -> dict[Route, int]:
    """The bytes of one step summed by blocks (``topology.reduce: hosts``) by route:
    ``workers``/``servers`` are the roles' nodes, ``blocks`` the workers of each block (its
    leader first), ``snapshots[i]`` the bytes worker ``i`` sent its leader (0 where it shares
    the leader's node), ``sent[b][k]`` the bytes block ``b``'s leader sent server ``k`` of
    its sum (its slices, as they crossed), ``published[k]`` as for :func:`group_step_bytes`.
    Each leader's sum of server ``k``'s slices goes to server ``k``'s node; the values come
    back as they do there."""
    moved: Counter[Route] = Counter()
    for b, to_each in zip(blocks, sent, strict=True):
        lead = workers[b[0]]
        for i in b:
            if snapshots[i] and workers[i] != lead:
                moved[(workers[i], lead)] += snapshots[i]
        for node, n in zip(servers, to_each, strict=True):
            if node != lead:
                moved[(lead, node)] += n
    _values_back(moved, workers, servers, published)
    return dict(moved)


def _values_back(
    moved: Counter[Route], workers: Sequence[str], servers: Sequence[str], published: Sequence[int]
) -> None:
    """Each server's published values, pulled once by each other node with a worker."""
    readers = set(workers)
    for node, n in zip(servers, published, strict=True):
        if n:
            for reader in sorted(readers - {node}):
                moved[(node, reader)] += n


def per_host(
    steps: Iterable[Iterable[tuple[str, str, int]]], names: Mapping[str, str], n_steps: int
) -> dict[str, dict[str, int]]:
    """Bytes in and out of each host per step, the mean over ``n_steps`` steps of the routes
    ``steps`` (each step's ``(from, to, bytes)``), nodes named by ``names`` (a node missing
    there keeps its id). Only hosts that moved something are listed, sorted by name."""
    out: Counter[str] = Counter()
    into: Counter[str] = Counter()
    for routes in steps:
        for src, dst, n in routes:
            out[names.get(src, src)] += n
            into[names.get(dst, dst)] += n
    hosts = sorted(set(out) | set(into))
    k = max(n_steps, 1)
    return {h: {"in": round(into[h] / k), "out": round(out[h] / k)} for h in hosts}


def host_names(nodes: Iterable[Mapping[str, object]]) -> dict[str, str]:
    """Node id -> the name its host is shown by: its IP address, with the node id's first 8
    characters where several live nodes share an address (Ray nodes started on one machine).
    ``nodes`` as ``ray.nodes()`` lists them."""
    alive = [n for n in nodes if n.get("Alive", True)]
    addrs = Counter(str(n.get("NodeManagerAddress")) for n in alive)
    names = {}
    for n in nodes:
        node, addr = str(n["NodeID"]), str(n.get("NodeManagerAddress"))
        names[node] = addr if addrs[addr] <= 1 else f"{addr}/{node[:8]}"
    return names


class HostNames:
    """:func:`host_names` of the cluster's nodes, as a function of a node id, asked of Ray again
    only for a node not seen before (a role replaced elsewhere): how the run's metrics and
    status name the hosts, as ``metrics.jsonl``'s ``net`` does."""

    def __init__(self) -> None:
        self.known: dict[str, str] = {}

    def __call__(self, node: str) -> str:
        if node not in self.known:
            import ray  # noqa: PLC0415

            self.known = host_names(ray.nodes())
        return self.known.get(node, node)
