"""raysinga: Apache SINGA's parameter-server architecture on Ray.

The single-process core (model spec, layers, optimizers, data, trainer) runs without Ray; it is the
reference the distributed trainer reproduces.
"""

from .layers import StepContext
from .model import LayerSpec, ModelSpec, Net

__version__ = "0.1.0"

__all__ = ["LayerSpec", "ModelSpec", "Net", "StepContext", "__version__"]
