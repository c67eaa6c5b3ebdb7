"""Storage every node can reach, checked before any role starts.

On a cluster of several machines, a server writes its checkpoint shard from its own node, a
role restarted after a loss reads checkpoints on whatever node it lands on, and each worker
opens the data set on its own node. A local ``checkpoint.dir`` or data path that is not the
same on every node fails there: at the first checkpoint, after training has run, or when a
role is replaced. So before any role starts, on a cluster of more than one node:

- the driver writes a token (a file of random text) where ``checkpoint.dir`` is, or would be
  made (its nearest directory that exists), and a task on every node that can host a role
  reads it back at the same path: a node that cannot, or cannot write there, stops the run;
- for each local data file, the same task compares the node's file with the driver's (size and
  a hash of its first MiB).

It is a probe, not a guess from the path: a path on a filesystem every node mounts passes, a
directory of the driver's own disk does not, whatever they are called. URIs (``s3://``, any
pyarrow filesystem) are reachable from anywhere and left alone. A single node keeps today's
behaviour. The token is removed at once; nothing else is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from pathlib import Path
from typing import Any

from . import node_probe

PROBE_S = 60.0  # the nodes' Python workers are up already (the import check started them)
TOKEN_PREFIX = ".raysinga-reach-"


class StorageUnreachable(ValueError):
    """A node that may host a role does not see the run's storage or data as the driver's
    node does; the message says which node, which path and what to do."""


def role_nodes(skip: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """The live nodes a role may be placed on (those with CPUs or GPUs, but ``skip``: nodes
    found unreachable), and the driver's."""
    import ray  # noqa: PLC0415

    here = ray.get_runtime_context().get_node_id()
    return [
        n
        for n in ray.nodes()
        if n.get("Alive")
        and n["NodeID"] not in skip
        and (
            n["NodeID"] == here or any(n.get("Resources", {}).get(r, 0) > 0 for r in ("CPU", "GPU"))
        )
    ]


def local_data_files(source: dict[str, Any]) -> list[str]:
    """The local files a job's data source reads, for its training and test splits."""
    from raysinga.data.kinds import Columns, Npy, Npz, has_split, source_spec  # noqa: PLC0415

    files: list[str] = []
    for split in ("train", "test"):
        if not has_split(source, split):
            continue
        src = source_spec(source, split)
        if isinstance(src, Npy):
            files += [src.x, src.y]
        elif isinstance(src, Npz):
            files.append(src.path)
        elif isinstance(src, Columns) and "://" not in src.path:
            files.append(src.path)
    return list(dict.fromkeys(os.path.abspath(f) for f in files))


def check(checkpoint_dir: str, data_files: list[str], skip: frozenset[str] = frozenset()) -> None:
    """Raise :class:`StorageUnreachable` where a node that may host a role (but ``skip``:
    nodes found unreachable) does not see ``checkpoint_dir`` (a local path) or one of
    ``data_files`` as this node does. Nothing is checked on a cluster of one node, nor for
    URIs."""
    import ray  # noqa: PLC0415
    from ray import cloudpickle  # noqa: PLC0415
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    nodes = role_nodes(skip)
    if len([n for n in ray.nodes() if n.get("Alive")]) <= 1:
        return
    here = ray.get_runtime_context().get_node_id()
    others = [n for n in nodes if n["NodeID"] != here]
    with _token(checkpoint_dir) as token:
        expect, what = [], []
        if token is not None:
            expect.append({"path": token[0], "token": token[1], "write": True})
            what.append(("checkpoint", checkpoint_dir, os.path.dirname(token[0])))
        for f in data_files:
            expect.append({"path": f, **_fingerprint(f)})
            what.append(("data", f, ""))
        if not expect or not others:
            return
        cloudpickle.register_pickle_by_value(node_probe)
        task = ray.remote(num_cpus=0, max_retries=0)(node_probe.look)
        refs = [
            task.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(expect)
            for n in others
        ]
        for ref, node in zip(refs, others, strict=True):
            try:
                seen = ray.get(ref, timeout=PROBE_S)
            except ray.exceptions.RayError as e:  # a timeout too: the node does not answer
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise StorageUnreachable(
                    f"node {node['NodeManagerAddress']} did not answer the storage check "
                    f"within {PROBE_S:g} s: {first}"
                ) from None
            for (kind, path, written), why in zip(what, seen["found"], strict=True):
                if why:
                    where = f"node {node['NodeManagerAddress']} ({seen['host']})"
                    raise StorageUnreachable(_message(kind, path, written, where, why))


def _message(kind: str, path: str, written: str, where: str, why: str) -> str:
    if kind == "checkpoint":
        return (
            f"checkpoint.dir {path} is not the same place on {where} as on the driver's "
            f"node: a token the driver wrote in {written} {why}. Servers write their shards "
            "from their own nodes and a replaced role reads checkpoints wherever it lands: "
            "mount one filesystem at that path on every node, or give checkpoint.dir as an "
            "s3:// (any pyarrow filesystem) URI"
        )
    return (
        f"data file {path} on {where} {why}: each worker reads the data on its own node; "
        "put it on a filesystem every node mounts, copy it to the same path on every node, "
        "or give an s3:// (any pyarrow filesystem) URI of Arrow or Parquet data"
    )


@contextlib.contextmanager
def _token(checkpoint_dir: str):
    """A token file written where ``checkpoint_dir`` is or would be made (its nearest
    existing directory), removed afterwards: yields (path, text), or None for a URI or where
    this node cannot write there (the run's own writes then say why)."""
    if "://" in checkpoint_dir and not checkpoint_dir.startswith("file://"):
        yield None
        return
    where = Path(os.path.abspath(checkpoint_dir.removeprefix("file://")))
    while not where.is_dir() and where != where.parent:
        where = where.parent
    text = secrets.token_hex(16)
    path = where / f"{TOKEN_PREFIX}{text[:12]}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        yield None
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        yield str(path), text
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def _fingerprint(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(node_probe.HEAD_BYTES)).hexdigest()
        return {"size": os.fstat(f.fileno()).st_size, "head": head}
