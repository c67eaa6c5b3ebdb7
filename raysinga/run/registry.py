"""The object-store copies of a run's checkpoints: the registry (a detached actor,
:func:`raysinga.checkpoint.objstore.registry`) keeps each committed checkpoint of a run in Ray's
object store under the run's key, so that a restart or another Ray task reads it from memory."""

from __future__ import annotations

from typing import Any

from raysinga.checkpoint import Location, storage


def key(run: str, root: str | Location) -> str:
    """How the object-store registry names a training run's checkpoints: by run name and
    checkpoint directory (two runs of one name in two directories are two runs)."""
    return f"{run}@{storage.resolve(root)}"


def actor(create: bool = False) -> Any:
    """The registry actor (None while there is none, unless ``create``)."""
    from raysinga.checkpoint import objstore  # noqa: PLC0415

    try:
        return objstore.registry(create=create)
    except ValueError:  # no registry yet
        return None


def lookup(run_key: str) -> dict[str, Any] | None:
    """The registry's newest copy of a run, if its object is still there."""
    import ray  # noqa: PLC0415

    reg = actor()
    entry = None if reg is None else ray.get(reg.lookup.remote(run_key))
    if entry is None:
        return None
    ready, _ = ray.wait(entry["refs"], timeout=0, fetch_local=False)
    return entry if ready else None


def forget(run_key: str) -> None:
    """Drop the registry's object-store copies of a run (it starts over)."""
    import ray  # noqa: PLC0415

    reg = actor()
    if reg is not None:
        drop(run_key, [e["step"] for e in ray.get(reg.list.remote(run_key))])


def drop(run_key: str, drop_steps: list[int], wait: bool = True) -> None:
    """Drop the registry's copies of these steps of a run (set aside on disk, say); ``wait``:
    until the registry has (else the calls are only sent, as after a prune: the checkpoints
    on disk are what counts)."""
    import ray  # noqa: PLC0415

    reg = actor()
    if reg is not None:
        calls = [reg.delete.remote(run_key, s) for s in drop_steps]
        if wait:
            ray.get(calls)


def keep_in_object_store(run_key: str, step: int, uri: str, adopting: list[Any]) -> None:
    """``checkpoint.object_store``: the registry (a detached actor, which then owns the object)
    puts the checkpoint just committed at ``uri`` into Ray's object store under ``run_key``
    (:func:`key`); the steps pruned from the directory are dropped from it (:func:`drop`). The
    call is not waited for; its ref joins ``adopting`` (those still running), for
    :func:`wait_adopted` at the end of the run."""
    import ray  # noqa: PLC0415

    reg = actor(create=True)
    if adopting:
        _, adopting[:] = ray.wait(adopting, num_returns=len(adopting), timeout=0)
    here = ray.get_runtime_context().get_node_id()  # it sees ``uri``; the registry may not
    adopting.append(reg.adopt.remote(run_key, step, uri, here))


def wait_adopted(adopting: list[Any], log: Any, timeout: float = 30.0) -> None:
    """Wait for the registry to hold the checkpoints handed to it: a driver that exits first can
    take its queued calls with it (a short run whose registry was still starting), leaving the
    object store without them. A copy that did not arrive is reported, not raised: the
    checkpoints on disk are committed all the same."""
    if not adopting:
        return
    import ray  # noqa: PLC0415

    try:
        ready, left = ray.wait(adopting, num_returns=len(adopting), timeout=timeout)
        problems = [f"not confirmed within {timeout:g} s"] if left else []
    except Exception as e:  # noqa: BLE001 - Ray gone (an interrupted run): not this run's error
        ready, problems = [], [repr(e)]
    adopting.clear()
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - any failure: the disk copy stands
            problems.append(str(e).strip().splitlines()[-1])
    if problems:
        log(
            "raysinga: the object store may lack a checkpoint's copy "
            f"({'; '.join(problems)}); the directory holds it"
        )
