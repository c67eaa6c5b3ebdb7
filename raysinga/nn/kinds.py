"""Every layer kind a model spec can name, by its ``kind``."""

from __future__ import annotations

from .layers import (
    AvgPool2D,
    BatchNorm,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    Layer,
    MaxPool2D,
    ReLU,
    Sigmoid,
    Tanh,
)
from .sequence import SEQUENCE_LAYERS

LAYERS: dict[str, type[Layer]] = {
    cls.kind: cls
    for cls in (
        Dense,
        Conv2D,
        MaxPool2D,
        AvgPool2D,
        ReLU,
        Sigmoid,
        Tanh,
        Flatten,
        Dropout,
        BatchNorm,
        *SEQUENCE_LAYERS,
    )
}
