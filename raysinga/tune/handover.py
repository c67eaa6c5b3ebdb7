"""How a trial's checkpoints reach Ray's object store: through the node's keeper, a detached
actor pinned to the node that reads a committed checkpoint out of the node's shared memory, puts
it into the object store and owns the object, so that it outlives the trial that made it.

:class:`Handover` does it in the background for a trial that keeps its process
(:mod:`.inplace`): the keeper reads the checkpoint while the trial's next steps run, the registry
records it as soon as it is there, a disk copy (``checkpoint_dir=``) is written beside, and the
trial waits only when Tune asks for the checkpoint's pointer.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from raysinga.checkpoint import CheckpointError, objstore
from raysinga.checkpoint import storage as ck_storage
from raysinga.checkpoint.placement import copy_dir

from .lineage import FORMAT

KEEPER_PREFIX = "raysinga-keeper-"


def keeper(node: str | None = None) -> Any:
    """The checkpoint keeper of this node (or ``node``): a detached actor pinned to it that puts
    the node's trial checkpoints into the object store and owns them (a registry of its own)."""
    import ray  # noqa: PLC0415
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    node = node or ray.get_runtime_context().get_node_id()
    return (
        ray.remote(objstore.CheckpointRegistry)
        .options(
            name=f"{KEEPER_PREFIX}{node}",
            namespace=objstore.REGISTRY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        )
        .remote()
    )


def held_steps(key: str) -> list[int]:
    """The steps of run ``key`` in the registry, oldest first."""
    import ray  # noqa: PLC0415

    return sorted(e["step"] for e in ray.get(objstore.registry().list.remote(key)))


def keepers() -> list[Any]:
    """Every node's keeper."""
    import ray  # noqa: PLC0415

    names = ray.util.list_named_actors(all_namespaces=True)
    return [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in names
        if a["namespace"] == objstore.REGISTRY_NAMESPACE and a["name"].startswith(KEEPER_PREFIX)
    ]


class Handover:
    """The checkpoints of one run of a trial (registry key ``key``) on their way into the object
    store and, where ``disk`` names a root, to disk. ``held``: the steps of the key that the
    registry holds already (earlier runs of the trial), which count toward ``keep``."""

    def __init__(self, key: str, trial: str, keep: int, disk: str | None, held: list[int]) -> None:
        self.key, self.trial, self.keep, self.disk = key, trial, keep, disk
        self.held = list(held)
        self.pending: dict[int, tuple[dict[str, Any], Any]] = {}  # step -> pointer, calls
        self.copies: dict[int, Future] = {}  # step -> its disk copy under way
        self.pointers: dict[int, dict[str, Any]] = {}
        self.shm: dict[int, dict[str, str]] = {}  # step -> where its committed files are
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="ckpt-copy") if disk else None

    def start(self, step: int, path: str, lineage: list[dict[str, Any]]) -> dict[str, Any]:
        """Send the checkpoint committed at ``path`` on its way; returns its pointer. The
        checkpoints before the previous one must be read by then (the run prunes them)."""
        import ray  # noqa: PLC0415

        for s in sorted(self.pending)[:-1]:
            self._settle(s)
        for s in sorted(self.copies)[:-1]:
            self.copies.pop(s).result()
        pointer = {
            "format": FORMAT,
            "key": self.key,
            "step": step,
            "trial": self.trial,
            "uri": f"{self.disk.rstrip('/')}/step-{step}" if self.disk else None,
            "lineage": lineage,
        }
        nbytes = sum(f.stat().st_size for f in Path(path).iterdir())
        refs = keeper().adopt.remote(self.key, step, path)
        # the registry's call waits for the keeper's (Ray resolves the argument first)
        done = objstore.registry().register.remote(
            self.key, step, refs, pointer["uri"], nbytes, pointer
        )
        if self.copier is not None and pointer["uri"]:
            src, dst = ck_storage.resolve(path), ck_storage.resolve(pointer["uri"])
            self.copies[step] = self.copier.submit(copy_dir, src, dst)
        self.pending[step] = (pointer, (refs, done))
        self.shm[step] = {"node": ray.get_runtime_context().get_node_id(), "path": str(path)}
        return pointer

    def pointer(self, step: int) -> dict[str, Any]:
        """The pointer of ``step``, at once: where the checkpoint is still on its way into the
        object store it says ``pending``, with where its committed files are (``shm``: this
        node and the directory in its shared memory). A reader on this node maps those files at
        once; one elsewhere waits for the keeper (:func:`.trials.fetch`)."""
        if step in self.pending:
            pointer, _ = self.pending[step]
            return {**pointer, "pending": True, "shm": self.shm[step]}
        return self.finish(step)

    def finish(self, step: int, disk: bool = False) -> dict[str, Any]:
        """The pointer of ``step`` once the object store holds it (and, with ``disk``, once its
        disk copy is whole)."""
        if step in self.pending:
            self._settle(step)
        if disk and step in self.copies:
            self.copies.pop(step).result()
        if step not in self.pointers:
            raise CheckpointError(f"{self.key} step {step}: no checkpoint of it was handed over")
        return self.pointers[step]

    def _settle(self, step: int) -> None:
        import ray  # noqa: PLC0415

        pointer, (refs, done) = self.pending.pop(step)
        self.shm.pop(step, None)
        got = ray.get(refs)
        ray.get(done)
        if not got:
            ray.get(objstore.registry().delete.remote(self.key, step))
            raise CheckpointError(f"{self.key} step {step}: gone before the object store had it")
        self.pointers[step] = pointer
        self.held = [*(s for s in self.held if s != step), step]
        while len(self.held) > self.keep:
            old = self.held.pop(0)  # an earlier run of the trial may have run on another node
            self.pointers.pop(old, None)
            ray.get([r.delete.remote(self.key, old) for r in (objstore.registry(), *keepers())])

    def close(self) -> None:
        """Wait for every checkpoint under way (before the run's working copies go)."""
        for s in sorted(self.pending):
            self._settle(s)
        for s in sorted(self.copies):
            self.copies.pop(s).result()
        if self.copier is not None:
            self.copier.shutdown(wait=True)
