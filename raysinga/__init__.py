"""raysinga: Apache SINGA's parameter-server architecture on Ray.

The single-process core (model spec, layers, optimizers, data, trainer) runs without Ray; it is the
reference the distributed trainer reproduces. Names are imported lazily, so that
``raysinga.checkpoint`` loads without the compute kernels.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# In a source checkout without an install (a Ray job's working_dir on a node, a run from the
# repository), raysinga.actors and raysinga.kernels are the repository's top-level actors/ and
# kernels/, as pyproject.toml maps them for an install.
_top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(os.path.dirname(__file__), "actors")) and os.path.isfile(
    os.path.join(_top, "actors", "__init__.py")
):
    __path__.append(_top)

_LAZY = {"StepContext": "layers", "LayerSpec": "model", "ModelSpec": "model", "Net": "model"}

__all__ = ["LayerSpec", "ModelSpec", "Net", "StepContext", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'raysinga' has no attribute {name!r}")
