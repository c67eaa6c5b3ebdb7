"""Letting go of a search's checkpoints: the object-store copies its trials handed over (held
by the registry and the nodes' keepers) and their working copies in the node's shared memory,
as Tune drops each trial (:class:`ReleaseStopped`) or when asked (:func:`release`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from raysinga.checkpoint import objstore

from .handover import keepers

try:
    from ray.tune import Callback
except ImportError as e:  # Ray without its tune extra
    raise ImportError(
        f"raysinga.tune needs Ray Tune: pip install 'raysinga[tune]' ({type(e).__name__}: {e})"
    ) from None

SHM_ROOT = "/dev/shm/raysinga-tune"  # the trials' working copies, by experiment and trial


def placement_name(experiment: str, trial: str) -> str:
    """The name of the placement group a distributed trial's run holds its roles in. Ray frees
    a placement group when the job that made it ends, not the trial's process: a trial that Tune
    stops (a stop criterion, a scheduler, a pause) before its run has freed the group leaves it,
    with the CPUs it holds, until the trial starts again (which removes it) or it is released
    (:class:`ReleaseStopped`, :func:`release`)."""
    return f"raysinga-tune:{experiment}/{trial}"


def drop_placements(experiment: str, trial: str | None = None) -> int:
    """Remove the placement groups the distributed runs of a search (or of one of its trials)
    left; returns how many."""
    from ray.util import get_placement_group, placement_group_table  # noqa: PLC0415
    from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

    want = placement_name(experiment, trial or "")
    names = {
        g.get("name") or "" for g in placement_group_table().values() if g.get("state") != "REMOVED"
    }
    gone = 0
    for name in sorted(n for n in names if (n == want if trial else n.startswith(want))):
        try:
            remove_placement_group(get_placement_group(name))
        except Exception:  # noqa: BLE001, S112 - removed meanwhile (ValueError), or Ray's own error
            continue
        gone += 1
    return gone


def drop_earlier(root: Path, trial: str) -> None:
    """Remove this trial's earlier working copies on this node (a trial that Tune stopped and
    started again cannot clean up after itself)."""
    for d in root.glob(f"{trial}-*") if root.is_dir() else ():
        shutil.rmtree(d, ignore_errors=True)


class ReleaseStopped(Callback):
    """A Ray Tune callback (``RunConfig(callbacks=[ReleaseStopped()])``) that drops a trial's
    object-store checkpoints as soon as Tune drops the trial: stopped early by its scheduler
    (ASHA, a stopper) or failed. A trial that ran to its last step keeps its final checkpoints
    (its result) until :func:`release`; ``at_end`` releases the whole search when it ends. The
    placement group of every trial Tune ends goes at once (:func:`placement_name`)."""

    def __init__(self, at_end: bool = False) -> None:
        self.at_end = at_end
        self.released: list[str] = []

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if not (trial.last_result or {}).get("finished", False):
            self._drop(trial)
        else:  # ended by a stop criterion at its last step, before its run freed the group
            drop_placements(trial.storage.experiment_dir_name, trial.trial_id)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._drop(trial)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        for t in trials if self.at_end else ():
            self._drop(t)

    def _drop(self, trial: Any) -> None:
        release(trial.storage.experiment_dir_name, trial.trial_id)
        self.released.append(trial.trial_id)


def release(experiment: str, trial: str | None = None) -> int:
    """Drop the object-store checkpoints of a search (or of one of its trials) from the
    registry, the working copies on this node and the placement groups its distributed runs
    left (a search's trials must have ended); returns how many objects were dropped."""
    import ray  # noqa: PLC0415

    drop_placements(experiment, trial)

    prefix = f"tune/{experiment}/" + (trial or "")
    gone = 0
    for i, reg in enumerate([objstore.registry(), *keepers()]):
        for e in ray.get(reg.list.remote()):
            if e["run"].startswith(prefix) and (trial is None or e["run"] == prefix):
                dropped = bool(ray.get(reg.delete.remote(e["run"], e["step"])))
                gone += dropped and i == 0
    shm = Path(SHM_ROOT, experiment)
    if trial is None:
        shutil.rmtree(shm, ignore_errors=True)
    else:
        drop_earlier(shm, trial)
    return gone
