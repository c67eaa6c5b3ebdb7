"""The net: a model spec of named layers, the layers (dense, convolution, pooling, batch norm,
dropout, and the sequence layers: embedding, attention, GRU, LSTM, ...), the losses, and weights
to and from PyTorch. Layers compute on NumPy or CuPy through :mod:`raysinga.kernels`; nothing here
needs Ray."""

from __future__ import annotations

from .kinds import LAYERS
from .layers import Layer, StepContext
from .losses import CLASSIFYING, LOSSES
from .model import LayerSpec, ModelSpec, Net

__all__ = [
    "CLASSIFYING",
    "LAYERS",
    "LOSSES",
    "Layer",
    "LayerSpec",
    "ModelSpec",
    "Net",
    "StepContext",
]
