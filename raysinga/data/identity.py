"""What a run's data cursor assumes about its data, saved in every training checkpoint and
checked when a run resumes.

The cursor counts batches (:mod:`raysinga.data.cursor`); which samples a batch holds follows
from the batch size, whether the order is shuffled, the number of samples and the seed. Resumed
with any of these changed, the same step would silently train on other samples, so a resume
refuses it and says which key changed. The contents are checked too, by a digest of a few rows
spread over the training split (cheap at any size; it catches a replaced file, not an edit of one
row).

A file behind a URI (``s3://...``, :mod:`raysinga.data.remote`) gets the same digest of the same
rows, read through the node's block cache: a few ranged reads, of blocks training reads anyway.
It names the contents, not the object: a run started on a local file resumes on its copy in
object storage, and an object uploaded again with the same bytes is no change. Size and
modification time would refuse both, and a hash of the footer would miss a rewrite of an Arrow
IPC file with other values in the same layout (its footer holds only the schema and offsets).
That the blocks read are the object's current ones, not a cached former version, is the
cache's part: it is keyed by the object's size and version (ETag, Last-Modified).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from raysinga.checkpoint import Checkpoint, CheckpointError

ROWS_HASHED = 32  # rows of the training split that go into its digest, evenly spread


def identity(train: Any, batch_size: int, shuffle: bool) -> dict[str, Any]:
    """The manifest's ``run.data``: batch size, order, sample count and shape, and a digest."""
    n = len(train)
    rows = np.unique(np.linspace(0, n - 1, num=min(n, ROWS_HASHED)).astype(np.int64))
    x, y = train.get(rows)
    h = xxhash.xxh3_64()
    for a in (np.ascontiguousarray(x), np.ascontiguousarray(y)):
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return {
        "batch_size": int(batch_size),
        "shuffle": bool(shuffle),
        "num_samples": n,
        "sample_shape": [int(d) for d in train.sample_shape],
        "digest": h.hexdigest(),
    }


def check_resume(ck: Checkpoint, run: dict[str, Any], now: dict[str, Any]) -> None:
    """Refuse to resume ``ck`` (run state ``run``) on data that maps its steps onto other
    samples. A checkpoint written before ``run.data`` existed is checked on what its saved job
    says (batch size and order)."""
    saved = run.get("data")
    if saved is None:
        data = (run.get("config") or {}).get("data") or {}
        saved = {k: data[k] for k in ("batch_size", "shuffle") if k in data}
    fix = (
        "the data cursor counts batches, so the run would go on with other samples than it "
        "would have; resume with the checkpoint's setting, or start a new run from its "
        "parameters with --init-from"
    )
    for key in ("batch_size", "shuffle"):
        if key in saved and saved[key] != now[key]:
            raise CheckpointError(
                f"{ck.location}: data.{key} is {now[key]!r} in the job but {saved[key]!r} in the "
                f"checkpoint; {fix}"
            )
    if "num_samples" in saved and (saved["num_samples"], saved["sample_shape"]) != (
        now["num_samples"],
        now["sample_shape"],
    ):
        raise CheckpointError(
            f"{ck.location}: data.source has {now['num_samples']} training samples of shape "
            f"{now['sample_shape']}, the checkpoint's run had {saved['num_samples']} of shape "
            f"{saved['sample_shape']}; {fix}"
        )
    if "digest" in saved and saved["digest"] != now["digest"]:
        raise CheckpointError(
            f"{ck.location}: data.source holds other training samples than the checkpoint's "
            f"run had (same count and shape, different contents); {fix}"
        )
