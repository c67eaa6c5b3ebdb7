"""Hyperparameter search with Ray Tune: a raysinga job as a Tune trainable (:mod:`.trainable`)
whose checkpoints pass from trial to trial through Ray's object store, and the lineage of each
trial, which replays bit-exact (:mod:`.lineage`). Needs Ray Tune (``pip install
'raysinga[tune]'``)."""

from __future__ import annotations

from .lineage import read_pointer, replay
from .trials import ReleaseStopped, TrialSpec, fetch, fetch_newest, release, trainable

__all__ = [
    "ReleaseStopped",
    "TrialSpec",
    "fetch",
    "fetch_newest",
    "read_pointer",
    "release",
    "replay",
    "trainable",
]
