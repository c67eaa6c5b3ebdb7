"""raysinga: Apache SINGA's parameter-server architecture on Ray.

The single-process core (model spec, layers, optimizers, data, trainer) runs without Ray; it is the
reference the distributed trainer reproduces. Names are imported lazily, so that
``raysinga.checkpoint`` loads without the compute kernels.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {"StepContext": "layers", "LayerSpec": "model", "ModelSpec": "model", "Net": "model"}

__all__ = ["LayerSpec", "ModelSpec", "Net", "StepContext", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'raysinga' has no attribute {name!r}")
