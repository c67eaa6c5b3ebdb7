"""The net: a model spec of named layers, the layers (dense, convolution, pooling, batch norm,
dropout, and the sequence layers: embedding, attention, GRU, LSTM, ...), the losses, and weights
to and from PyTorch; layers and losses of the user's own, named by import path or registered
(:mod:`.registry`), and the check they pass (:mod:`.testing`). Layers compute on NumPy or CuPy
through :mod:`raysinga.kernels`; nothing here needs Ray."""

from __future__ import annotations

from .kinds import LAYERS
from .layers import Layer, StepContext
from .losses import CLASSIFYING, LOSSES
from .model import LayerSpec, ModelSpec, Net
from .registry import register_layer, register_loss

__all__ = [
    "CLASSIFYING",
    "LAYERS",
    "LOSSES",
    "Layer",
    "LayerSpec",
    "ModelSpec",
    "Net",
    "StepContext",
    "register_layer",
    "register_loss",
]
