"""Population-based bandits (Ray Tune's :class:`~ray.tune.schedulers.pb2.PB2`: PBT whose
explore step fits a Gaussian process to the trials' gains) with :class:`~.pbt.InPlacePBT`'s
exploits in the trial's process and its synchronous mode that survives a failed trial. Its own
module: PB2's imports (pandas, scikit-learn) load only where it is used."""

from __future__ import annotations

from ray.tune.schedulers.pb2 import PB2

from .pbt import InPlacePBT

__all__ = ["InPlacePB2"]


class InPlacePB2(InPlacePBT, PB2):
    """Ray Tune's :class:`PB2` (the same arguments, the same choices of configuration),
    exploiting a running :func:`~raysinga.tune.in_place` trial in its process as
    :class:`~.pbt.InPlacePBT` does."""
