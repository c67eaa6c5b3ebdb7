"""Checkpoints: msgpack manifest + Arrow IPC shards + a text parameter table (format version 1).

A checkpoint loads with the library alone: no cluster, no GPU (this package imports neither
``raysinga.actors`` nor ``raysinga.kernels``), and no pickle anywhere, so a checkpoint from a
stranger cannot run code.
"""

from .export import export
from .finetune import MatchReport, match
from .format import FORMAT_VERSION, CheckpointError, TensorInfo
from .lock import RunLock
from .manage import Latest, latest, prune, save, steps, tensors_of
from .reader import Checkpoint
from .storage import Location, resolve
from .writer import begin, commit, write_shard

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointError",
    "Latest",
    "Location",
    "MatchReport",
    "RunLock",
    "TensorInfo",
    "begin",
    "commit",
    "export",
    "latest",
    "match",
    "prune",
    "resolve",
    "save",
    "steps",
    "tensors_of",
    "write_shard",
]
