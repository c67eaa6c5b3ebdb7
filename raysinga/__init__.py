"""raysinga: Apache SINGA's parameter-server architecture on Ray.

The parts, one subpackage each (``docs/api.md`` is the tour)::

    config        the job: typed, validated sections of a YAML file or a dict
    nn            the model spec, layers and losses
    optim         optimizers, learning-rate schedules, gradient arithmetic
    data          data sets by index, the deterministic batch order, the data cursor
    checkpoint    the checkpoint format: write, read, verify, manage, object store
    run           one run: its session, checkpoints and record; the single-process trainer
    obs           events and what subscribes to them: console, progress, metrics files
    cluster       the Ray cluster a run uses: joining it, shipping code to its nodes
    distributed   the distributed trainer: controller, placement of roles, recovery
    actors        the roles as plain classes: parameter server, worker, stub
    kernels       the array ops on NumPy or CuPy raw CUDA kernels
    tune          Ray Tune: trainable, lineage and replay
    cli           the ``raysinga`` command

The single-process core (config, nn, optim, data, run) runs without Ray; it is the reference the
distributed trainer reproduces. The names below are imported on first use, so that
``import raysinga.checkpoint`` loads neither the kernels nor Ray.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path
from typing import Any

__version__ = "0.1.0"


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """``raysinga.actors`` and ``raysinga.kernels`` from a source checkout's top-level
    ``actors/`` and ``kernels/`` (a Ray job's working directory, a run from the repository
    without an install), as pyproject.toml's package-dir maps them for an install. Only these
    two names: the rest of the repository is not importable as part of the package."""

    def __init__(self, top: Path) -> None:
        self.top = top

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in ("raysinga.actors", "raysinga.kernels"):
            return None
        where = self.top / fullname.rpartition(".")[2]
        return importlib.util.spec_from_file_location(
            fullname, where / "__init__.py", submodule_search_locations=[str(where)]
        )


_here = Path(__file__).resolve().parent
if not (_here / "actors").is_dir() and (_here.parent / "actors" / "__init__.py").is_file():
    if not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.append(_CheckoutFinder(_here.parent))

_LAZY = {
    "Checkpoint": "raysinga.checkpoint",
    "DistributedTrainer": "raysinga.distributed",
    "JobConfig": "raysinga.config",
    "LayerSpec": "raysinga.nn",
    "ModelSpec": "raysinga.nn",
    "Net": "raysinga.nn",
    "StepContext": "raysinga.nn",
    "TrainResult": "raysinga.obs",
    "Trainer": "raysinga.run",
}

__all__ = [*sorted(_LAZY), "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raysinga' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
