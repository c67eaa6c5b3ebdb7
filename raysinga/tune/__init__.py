"""Hyperparameter search with Ray Tune: a raysinga job as a Tune trainable (:mod:`.trainable`)
whose checkpoints pass from trial to trial through Ray's object store, a class trainable
whose trials keep their process across population-based training's exploits
(:mod:`.inplace`, over :mod:`.handover`), and the lineage of each
trial, which replays bit-exact (:mod:`.lineage`). Needs Ray Tune (``pip install
'raysinga[tune]'``)."""

from __future__ import annotations

from .events import TrialLog, TrialReported, TrialStarted
from .inplace import InPlaceTrial, in_place
from .lineage import read_pointer, replay
from .pbt import InPlacePBT
from .release import ReleaseStopped, release
from .trials import TrialSpec, fetch, fetch_newest, trainable

__all__ = [
    "InPlacePBT",
    "InPlaceTrial",
    "TrialLog",
    "TrialReported",
    "TrialStarted",
    "in_place",
    "ReleaseStopped",
    "TrialSpec",
    "fetch",
    "fetch_newest",
    "read_pointer",
    "release",
    "replay",
    "trainable",
]
