"""Checkpoints in Ray's object store: one ObjectRef per checkpoint, read back zero-copy.

The object is a single uint8 array holding the checkpoint's files back to back (a small msgpack
index in front), so it is the very bytes of the directory format: the same validation applies, no
pickle of ours is involved, and a reader on the same node maps it straight out of shared memory.
Every file is hashed against the manifest as it is copied in, so a put of a damaged directory
fails and an object, once made, is as trustworthy as a fully verified directory.
A named, detached :class:`CheckpointRegistry` actor can own these objects (it puts them itself,
or has a task on a node that sees the checkpoint's directory pack them), so they outlive the job
that made them; when an object is lost, :func:`fetch` falls back to the
disk copy.
"""

from __future__ import annotations

import functools
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import numpy as np
import xxhash

from . import storage
from .format import MANIFEST, CheckpointError
from .manifest import unseal
from .reader import Checkpoint
from .storage import Location

MAGIC = b"RSCKPT01"
ALIGN = 64
COPY_PIECE = 4 << 20  # read, then hashed while in cache
REGISTRY_NAME = "raysinga-checkpoints"
REGISTRY_NAMESPACE = "raysinga"


def pack(where: str | Location) -> np.ndarray:
    """The files of a committed checkpoint directory as one array (one copy of the bytes),
    each file hashed as it is copied and refused unless it matches its manifest: a copy that
    readers trust with ``verify="fast"`` (as resume does) must be as good as a full check."""
    loc = storage.resolve(where)
    manifest = storage.read_bytes(loc.join(MANIFEST))
    listed = unseal(loc.join(MANIFEST), manifest)["files"]
    for f in listed:
        got = storage.size(loc.join(f["file"]))
        if got is None:
            raise CheckpointError(f"{loc.join(f['file'])}: missing")
        if got != f["size"]:
            raise CheckpointError(
                f"{loc.join(f['file'])}: size {got} bytes, manifest says {f['size']}"
            )
    index, off = [], 0
    for n, s in [(f["file"], f["size"]) for f in listed] + [(MANIFEST, len(manifest))]:
        index.append([n, off, s])
        off += -(-s // ALIGN) * ALIGN
    head = msgpack.packb({"files": index}, use_bin_type=True)
    start = -(-(len(MAGIC) + 8 + len(head)) // ALIGN) * ALIGN
    out = np.zeros(start + off, np.uint8)
    out[: len(MAGIC) + 8 + len(head)] = np.frombuffer(
        MAGIC + struct.pack("<Q", len(head)) + head, np.uint8
    )
    _, o, s = index[-1]
    out[start + o : start + o + s] = np.frombuffer(manifest, np.uint8)  # unseal checked it
    dsts = [out[start + o : start + o + s] for _, o, s in index[:-1]]
    # files side by side, as Checkpoint.open hashes them: reads and xxhash let go of the GIL
    with ThreadPoolExecutor(min(4, len(listed) or 1)) as pool:
        digests = pool.map(_copy_hashed, [loc.join(f["file"]) for f in listed], dsts)
        for f, digest in zip(listed, digests, strict=True):
            if digest != f["xxh3"]:
                raise CheckpointError(
                    f"{loc.join(f['file'])}: checksum mismatch: the file is corrupt"
                )
    return out


def _copy_hashed(loc: Location, dst: np.ndarray) -> str:
    """Read the file at ``loc`` into ``dst`` (its size) and return its XXH3-64, hashing each
    piece as soon as it lands, while it is still in cache: the bytes are read once."""
    h, mv = xxhash.xxh3_64(), memoryview(dst)
    with loc.fs.open_input_stream(loc.path) as f:  # one sequential read, on object stores too
        for at in range(0, len(mv), COPY_PIECE):
            piece, got = mv[at : at + COPY_PIECE], 0
            while got < len(piece):
                n = f.readinto(piece[got:])
                if not n:
                    raise CheckpointError(f"{loc}: shorter than its manifest says")
                got += n
            h.update(piece)
    return h.hexdigest()


def unpack(buf: Any, label: str = "object") -> dict[str, memoryview]:
    """File name -> bytes (views into ``buf``, no copy)."""
    mv = memoryview(buf).cast("B")
    try:
        if bytes(mv[: len(MAGIC)]) != MAGIC:
            raise ValueError("bad magic")
        (hlen,) = struct.unpack("<Q", mv[len(MAGIC) : len(MAGIC) + 8])
        head = msgpack.unpackb(bytes(mv[len(MAGIC) + 8 : len(MAGIC) + 8 + hlen]), raw=False)
        start = -(-(len(MAGIC) + 8 + hlen) // ALIGN) * ALIGN
        files = {}
        for n, o, s in head["files"]:
            if not (isinstance(n, str) and 0 <= o and 0 <= s and start + o + s <= len(mv)):
                raise ValueError("index out of range")
            files[n] = mv[start + o : start + o + s]
        return files
    except Exception as e:  # noqa: BLE001 - malformed object, whatever the cause
        raise CheckpointError(f"{label}: not a packed raysinga checkpoint ({e})") from None


def put(where: str | Location) -> Any:
    """Put a committed checkpoint into the object store, owned by this process."""
    import ray  # noqa: PLC0415

    return ray.put(pack(where))


def get(ref: Any, verify: str = "fast") -> Checkpoint:
    """The checkpoint behind ``ref``, its tensors read-only views of the shared object."""
    import ray  # noqa: PLC0415

    arr = ray.get(ref)
    label = f"object {ref.hex()[:16]}"
    return Checkpoint.from_buffers(unpack(arr, label), label, verify=verify)


class CheckpointRegistry:
    """A detached actor's table of checkpoints by (run, step): ObjectRef and disk location."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], dict[str, Any]] = {}

    def register(
        self,
        run: str,
        step: int,
        refs: list[Any],
        uri: str | None,
        nbytes: int,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Record a checkpoint object that someone else owns (it lives as long as its owner),
        with ``meta``, what its maker wants a reader to know (returned by :meth:`lookup`)."""
        self._entries[(run, step)] = {"refs": refs, "uri": uri, "nbytes": nbytes, "meta": meta}

    def adopt(self, run: str, step: int, uri: str, node: str | None = None) -> list[Any]:
        """Put the committed checkpoint at ``uri`` into the object store from this actor, which
        thereby owns the object: it outlives the job that asked. ``node``: the Ray node of the
        caller, which sees ``uri``; where this actor runs on another (a machine that may not
        mount the run's directory at all), a task there packs it, and this actor owns the
        result all the same (its copy stays on that node; lost with it, a read falls back to
        ``uri``). Returns ``[ref]``, or ``[]`` when the directory is gone: calls wait while
        this actor restarts (its node was lost), and by then the run may have pruned the
        checkpoint, which the store need not hold either."""
        import ray  # noqa: PLC0415
        from ray.util.scheduling_strategies import (  # noqa: PLC0415
            NodeAffinitySchedulingStrategy,
        )

        if node is None or node == ray.get_runtime_context().get_node_id():
            try:
                arr = pack(uri)
            except FileNotFoundError:
                return []
            ref, nbytes = ray.put(arr), int(arr.nbytes)
        else:  # soft: where that node is gone, any node that sees ``uri`` packs it
            there = NodeAffinitySchedulingStrategy(node, soft=True)
            size, ref = _pack_task().options(scheduling_strategy=there).remote(uri)
            try:
                nbytes = ray.get(size)
            except FileNotFoundError:  # Ray's error of the task is one too
                return []
        self._entries[(run, step)] = {"refs": [ref], "uri": uri, "nbytes": nbytes}
        return [ref]

    def lookup(self, run: str, step: int | None = None) -> dict[str, Any] | None:
        """The entry of ``step``, or of the run's newest step when ``step`` is None."""
        if step is None:
            steps = [s for r, s in self._entries if r == run]
            if not steps:
                return None
            step = max(steps)
        e = self._entries.get((run, step))
        return None if e is None else {**e, "run": run, "step": step}

    def list(self, run: str | None = None) -> list[dict[str, Any]]:
        return [
            {"run": r, "step": s, "uri": e["uri"], "nbytes": e["nbytes"]}
            for (r, s), e in sorted(self._entries.items())
            if run is None or r == run
        ]

    def delete(self, run: str, step: int) -> bool:
        return self._entries.pop((run, step), None) is not None


def _pack_on_node(uri: str) -> tuple[int, np.ndarray]:
    """:func:`pack` as a task: its size, and the array."""
    arr = pack(uri)
    return int(arr.nbytes), arr


@functools.cache
def _pack_task() -> Any:
    import ray  # noqa: PLC0415

    # no CPU of Ray's: the node's CPUs may all be held by a run's roles
    return ray.remote(num_returns=2, num_cpus=0)(_pack_on_node)


def registry(create: bool = True) -> Any:
    """The cluster's registry actor (named, detached: it outlives jobs)."""
    import ray  # noqa: PLC0415

    try:
        return ray.get_actor(REGISTRY_NAME, namespace=REGISTRY_NAMESPACE)
    except ValueError:
        if not create:
            raise
    return (
        ray.remote(CheckpointRegistry)
        .options(
            name=REGISTRY_NAME,
            namespace=REGISTRY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            # not in the placement group of whoever asks first (a Ray Tune trial, a task in a
            # group that captures its children): the group's end would take the registry along
            scheduling_strategy="DEFAULT",
        )
        .remote()
    )


def publish(where: str | Location, run: str, reg: Any = None) -> Any:
    """Put a committed checkpoint in the object store, owned by the registry; returns the ref."""
    import ray  # noqa: PLC0415

    reg = reg or registry()
    loc = storage.resolve(where)
    ck = Checkpoint.open(loc, verify="fast")
    here = ray.get_runtime_context().get_node_id()
    return ray.get(reg.adopt.remote(run, ck.step, str(loc), here))[0]


def fetch(run: str, step: int | None = None, reg: Any = None, verify: str = "fast") -> Checkpoint:
    """A registered checkpoint from the object store, or from its disk copy if the object is
    gone (its node died, or it was evicted)."""
    import ray  # noqa: PLC0415
    from ray.exceptions import ObjectLostError, OwnerDiedError, RayError  # noqa: PLC0415

    reg = reg or registry(create=False)
    entry = ray.get(reg.lookup.remote(run, step))
    if entry is None:
        raise CheckpointError(
            f"no checkpoint of run {run!r}"
            + (f" at step {step}" if step is not None else "")
            + " in the registry"
        )
    try:
        return get(entry["refs"][0], verify=verify)
    except (ObjectLostError, OwnerDiedError, RayError) as e:
        if not entry["uri"]:
            raise CheckpointError(
                f"run {run!r} step {entry['step']}: the object is lost "
                f"({type(e).__name__}) and there is no disk copy"
            ) from None
        return Checkpoint.open(entry["uri"], verify="full")
