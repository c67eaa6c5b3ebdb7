"""Checking that a topology fits the cluster, placing the roles and spawning them.

A topology that cannot fit fails here within seconds with what is missing, instead of hanging on a
pending placement group. Actor classes are plain classes made remote at spawn time, so tests can
pass in failing or slow variants.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from raysinga.config.topology import Resources, Topology


class ResourceError(RuntimeError):
    """The cluster cannot hold the topology; the message names what is missing."""


def check_fits(topo: Topology) -> None:
    """Refuse a topology larger than the cluster, naming the resources that fall short."""
    import ray  # noqa: PLC0415

    total = ray.cluster_resources()
    need = topo.total()
    short = [
        f"{k}: needs {v:g}, cluster has {total.get(k, 0):g}"
        for k, v in need.items()
        if v > total.get(k, 0) + 1e-9
    ]
    if short:
        raise ResourceError(
            f"the topology ({topo.n_servers} servers, {topo.n_groups} groups x "
            f"{topo.workers_per_group} workers) does not fit the cluster: "
            + "; ".join(short)
            + ". Lower the counts or the per-role resources (topology.worker/server/stub)."
        )
    nodes = live_nodes()
    for role, res in (("worker", topo.worker), ("server", topo.server), ("stub", topo.stub)):
        if res.empty:
            continue
        bundle = res.as_bundle()
        if not any(all(node.get(k, 0) + 1e-9 >= v for k, v in bundle.items()) for node in nodes):
            raise ResourceError(
                f"no node can hold one {role} ({bundle}); the largest node has "
                f"{max(nodes, key=lambda n: n.get('CPU', 0)) if nodes else {}}"
            )


@dataclass
class Placement:
    """A placement group and the bundle index of every role instance."""

    pg: Any
    workers: list[list[int]] = field(default_factory=list)  # [group][worker] -> bundle
    servers: list[int] = field(default_factory=list)
    stubs: list[int] = field(default_factory=list)


def _merge(*rs: Resources) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in rs:
        for k, v in r.as_bundle().items():
            out[k] = out.get(k, 0.0) + v
    return out


def _layout(topo: Topology) -> tuple[list[dict[str, float]], Placement]:
    """The bundles the topology asks for, and which role goes in which."""
    bundles: list[dict[str, float]] = []
    p = Placement(pg=None)
    colocate = topo.preset == "allreduce"
    # reduce: hosts puts each block of workers (summed together) in one bundle: on one node
    per = topo.workers_per_host if topo.reduce == "hosts" else 1
    for _ in range(topo.n_groups):
        row = []
        for i in range(topo.workers_per_group):
            if i % per == 0:
                block = [topo.worker] * per + ([topo.server] if colocate else [])
                bundles.append(_merge(*block))
            row.append(len(bundles) - 1)
        p.workers.append(row)
    flat_blocks = sorted({b for row in p.workers for b in row})
    for k in range(topo.n_servers):
        if colocate or topo.server.empty:  # ride in a block's bundle, on that block's node
            p.servers.append(flat_blocks[k % len(flat_blocks)])
        else:
            p.servers.append(len(bundles))
            bundles.append(_merge(topo.server))
    for g in range(topo.n_groups):
        if topo.stub.empty:
            p.stubs.append(p.workers[g][0])
        else:
            p.stubs.append(len(bundles))
            bundles.append(_merge(topo.stub))
    return bundles, p


def place(
    topo: Topology, timeout_s: float = 30.0, name: str = "", avoid: frozenset[str] = frozenset()
) -> Placement:
    """Reserve the topology's resources; ``allreduce`` puts server ``i`` with worker ``i``;
    nothing goes on nodes ``avoid`` (Ray's ids of nodes the run found unreachable).

    ``name``: one that only this run uses: a placement group of that name is left from an
    earlier start of it whose driver was stopped without freeing it (a Ray Tune trial, whose
    group lives as long as the Tune job), and is removed before the new one is made."""
    import ray  # noqa: PLC0415
    from ray.util import get_placement_group  # noqa: PLC0415
    from ray.util.placement_group import placement_group, remove_placement_group  # noqa: PLC0415

    bundles, p = _layout(topo)
    if name:
        try:
            remove_placement_group(get_placement_group(name))
        except Exception:  # noqa: BLE001, S110 - none of that name (ValueError), or gone already
            pass
    selector = [{"ray.io/node-id": f"!in({','.join(sorted(avoid))})"}] * len(bundles)
    p.pg = placement_group(
        bundles, strategy="PACK", name=name, bundle_label_selector=selector if avoid else None
    )
    ready, _ = ray.wait([p.pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(p.pg)
        raise ResourceError(
            f"the cluster did not grant {len(bundles)} bundles ({topo.total()}) within "
            f"{timeout_s:g} s: other jobs may hold them (ray status shows what is in use)"
        )
    return p


def relocated(
    bundles: list[dict[str, float]], avoid: set[str], timeout_s: float, prefer: str | None = None
) -> Any:
    """A placement group of ``bundles`` on nodes other than ``avoid`` (Ray's node ids: nodes
    the run found unreachable, which Ray still counts as alive), on node ``prefer`` where it
    has room (where spares wait), ready; None where the live nodes have no room for them
    within ``timeout_s``."""
    import ray  # noqa: PLC0415
    from ray.util.placement_group import placement_group, remove_placement_group  # noqa: PLC0415

    tries = [f"in({prefer})"] if prefer and prefer not in avoid else []
    tries.append(f"!in({','.join(sorted(avoid))})")
    for i, where in enumerate(tries):
        selector = [{"ray.io/node-id": where}] * len(bundles)
        pg = placement_group(bundles, strategy="PACK", bundle_label_selector=selector)
        last = i == len(tries) - 1
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s if last else min(1.0, timeout_s))
        if ready:
            return pg
        remove_placement_group(pg)
    return None


def live_nodes() -> list[dict[str, float]]:
    """The resources of every node Ray counts as alive."""
    import ray  # noqa: PLC0415

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def packs(topo: Topology, nodes: list[dict[str, float]]) -> bool:
    """Whether the topology's bundles fit the nodes' resources (first fit, largest first: a
    quick check before asking Ray, which has the last word)."""
    bundles, _ = _layout(topo)
    free = [dict(n) for n in nodes]
    for b in sorted(bundles, key=lambda b: -sum(b.values())):
        for n in free:
            if all(n.get(k, 0.0) + 1e-9 >= v for k, v in b.items()):
                for k, v in b.items():
                    n[k] = n.get(k, 0.0) - v
                break
        else:
            return False
    return True


def shrunk(topo: Topology, min_groups: int, min_workers: int) -> list[Topology]:
    """The topology and its smaller forms down to the given bounds, largest first: fewer
    workers per group before fewer groups."""
    return [
        topo.resized(g, w)
        for g in range(topo.n_groups, min_groups - 1, -1)
        for w in range(topo.workers_per_group, min_workers - 1, -1)
    ]


def spawn(
    cls: type, pg: Any, bundle: int, res: Resources, *args: Any, env: dict | None = None
) -> Any:
    """Make ``cls`` remote now, pinned to bundle ``bundle`` of placement group ``pg``, in the
    runtime environment ``env`` beyond the job's (None: the job's)."""
    from ray.util.scheduling_strategies import (  # noqa: PLC0415
        PlacementGroupSchedulingStrategy,
    )

    strategy = PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=bundle
    )
    opts: dict[str, Any] = {"num_cpus": res.cpus, "scheduling_strategy": strategy}
    if res.gpus:
        opts["num_gpus"] = res.gpus
    if res.memory:
        opts["memory"] = res.memory
    if env:
        opts["runtime_env"] = env
    return _remote(cls, opts, args)


def spawn_spare(
    cls: type, node_id: str, *args: Any, gpus: str | None = None, env: dict | None = None
) -> Any:
    """Make ``cls`` remote now on node ``node_id``, outside the placement group and holding
    no resources: a spare that waits, idle, to take over from a lost role of its kind there
    (it then runs on the CPUs, and the share of a GPU, the lost role leaves). ``env``: the
    runtime environment beyond the job's, as :func:`spawn`'s.

    ``gpus``: the GPUs the spare of a GPU role sees (``CUDA_VISIBLE_DEVICES``, those of the
    roles it may replace). Holding no GPU of Ray's, it gets them through its environment
    (:func:`spare_env`)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    opts: dict[str, Any] = {
        "num_cpus": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
    }
    if gpus is not None or env:
        opts["runtime_env"] = dict(env or {})
    if gpus is not None:
        given = opts["runtime_env"].get("env_vars") or {}
        opts["runtime_env"]["env_vars"] = {**given, **spare_env(gpus)}
    return _remote(cls, opts, args)


def spare_env(gpus: str) -> dict[str, str]:
    """The environment of a GPU role's spare that sees ``gpus``. Ray 2.60 leaves
    ``CUDA_VISIBLE_DEVICES`` alone in a role given no GPU; Ray from before ray-project/ray#54868
    (which the ``ray>=2.40`` floor allows), and a cluster that sets
    ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1``, blank it, and the spare would see no GPU. Ray's
    own switches keep it: the override off, and ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``
    (every Ray since 2.40 reads it: Ray then never sets the variable in this process)."""
    return {
        "CUDA_VISIBLE_DEVICES": gpus,
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    }


def _remote(cls: type, opts: dict[str, Any], args: tuple) -> Any:
    import ray  # noqa: PLC0415

    opts = {**opts, "max_restarts": 0, "max_concurrency": 1}
    # Calls run one at a time, except those sent to the "control" group (Abortable.abort),
    # which must reach a role while its serve loop waits for a stub that is gone, and to the
    # "copies" group (a stub keeping a server's copy of itself, while the stub runs steps).
    remote = ray.remote(concurrency_groups={"control": 1, "copies": 1})(cls)
    return remote.options(**opts).remote(*args)


def remove_shared_files(tag: str) -> None:
    """After roles were killed outright: unlink their shared-memory files here at once, and on
    every other live node by a small task (not waited for)."""
    import ray  # noqa: PLC0415
    from ray.util.scheduling_strategies import (  # noqa: PLC0415
        NodeAffinitySchedulingStrategy,
    )

    from .common.buffers import remove_files  # noqa: PLC0415

    remove_files(tag)
    here = ray.get_runtime_context().get_node_id()
    task = ray.remote(num_cpus=0)(remove_files)
    for node in ray.nodes():
        if node.get("Alive") and node["NodeID"] != here:
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            task.options(scheduling_strategy=strategy).remote(tag)


def first_death(actors: list[Any]) -> float | None:
    """When the first of ``actors`` to die (not by ``ray.kill``) died, as Ray's control store
    recorded it (seconds since the epoch); None if none has or Ray does not say."""
    try:  # the actor table; Ray has no public getter without its dashboard
        from ray._private import state  # noqa: PLC0415
    except ImportError:
        return None
    ends = []
    for a in actors:
        try:
            info = state.actors(actor_id=a._actor_id.hex())
        except Exception:  # noqa: BLE001 - a diagnostic only
            continue
        if not isinstance(info, dict) or info.get("State") != "DEAD" or not info.get("EndTime"):
            continue
        with contextlib.suppress(Exception):  # ray.kill is ours, not the failure
            ctx = info["DeathCause"].actor_died_error_context
            kinds = type(ctx).DESCRIPTOR.fields_by_name["reason"].enum_type.values_by_number
            if kinds[ctx.reason].name == "RAY_KILL":
                continue
        ends.append(info["EndTime"] / 1000.0)
    return min(ends) if ends else None
