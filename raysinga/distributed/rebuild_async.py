"""A lost server of asynchronous groups, rebuilt exactly while every group waits.

Each group's steps reach every server, in an order that only the server knows: a server on its
group 0's stub's node notes, after each update, which group's step it applied at which version
(:meth:`~raysinga.actors.memory.copies.CopyBuffer.note`, in its copies' file, which that stub maps).
Every group's stub logs its own steps' summed gradients (:class:`~raysinga.actors.memory.replay.
ReplayLog`). So a new server that loads the lost one's newest copy and applies the noted updates
since, each gradient from its own group's stub, in the noted order, ends with the lost server's
bits at its last update noted. An update the lost server applied and did not note (the kill came
between the two) is taken again when its group redoes that step, from the values then current:
asynchronous training does not fix the order of its updates in any case.
"""

from __future__ import annotations

import time

from raysinga.actors.common.errors import get_all

from .replace import Replaced, Replacer, answers
from .spares import live_nodes


def rebuild_async(replacer: Replacer, done: list[int], timeout_s: float = 20.0) -> Replaced | None:
    """Rebuild the lost servers of asynchronous groups, every group stopped (the caller has
    let their chunks end): each new server loads the lost one's newest copy (kept by group
    0's stub, which maps the copies of the servers on its node) and applies, in the order
    the lost server noted, the logged gradients of every group's steps since, each from its
    own group's stub. It ends with the lost server's bits at its last update noted. Returns
    each group's step to go on from (``positions``; at least ``done``), or None where that
    cannot be done: a worker or stub lost too, a lost node, a server on another node than
    group 0's stub (its order was not noted there), a group's log no longer holding a step
    to replay, or a role not answering within ``timeout_s``."""
    roles = replacer.roles
    t0 = time.perf_counter()
    if not roles.replay or not all(answers(st, timeout_s) for st in roles.stubs):
        return None
    lost = [k for k, sv in enumerate(roles.servers) if not answers(sv, timeout_s)]
    if not lost or any(
        not answers(w, timeout_s) for row in roles.workers for w in row
    ):  # nothing to rebuild, or a worker went too
        return None
    alive = live_nodes()
    replacer.spares.drop_off(alive)
    if any(roles.server_infos[k]["node"] not in alive for k in lost):
        return None
    roles.replaced = True
    new = {k: replacer.new_server(k) for k in lost}
    roles.spares += new.values()
    infos = get_all([a.describe.remote() for a in new.values()], "server", None, timeout_s)
    t1 = time.perf_counter()
    keeper, most = roles.stubs[0], 0
    for (k, actor), info in zip(new.items(), infos, strict=True):
        order = get_all([keeper.async_plan.remote(k)], "stub", 0)[0]
        if order is None:
            return None
        grads = get_all([roles.stubs[g].logged.remote(step, k) for _, g, step in order], "stub")
        if any(gr is None for gr in grads):
            return None
        start = get_all([keeper.restore_copy.remote(k, actor)], "stub", 0)[0]
        if start is None or (order and order[0][0] != start + 1):
            return None
        ups = [
            actor.update.remote(step, gr, g) for (_, g, step), gr in zip(order, grads, strict=True)
        ]
        get_all(ups, "server", indices=[k] * len(ups))
        version = get_all([actor.latest.remote()], "server", indices=[k])[0][0]
        if version != (order[-1][0] if order else start):
            return None
        roles.servers[k], roles.server_infos[k], most = actor, info, max(most, len(order))
    t2 = time.perf_counter()
    roles.publish_where_read()
    rewires = [
        st.rewire.remote(roles.workers[g], roles.worker_infos[g], roles.servers, roles.server_infos)
        for g, st in enumerate(roles.stubs)
    ]
    get_all(rewires, "stub")
    roles.keep_copies(list(new))
    positions = {g: replacer.async_position(g, d) for g, d in enumerate(done)}
    phases = {"stop_s": 0.0, "respawn_s": t1 - t0, "rebuild_s": t2 - t1}
    phases.update(rewire_s=time.perf_counter() - t2, nodes_lost=0)
    return Replaced(positions[0], phases, sorted(new), most, positions)
