"""The one backend switch: CuPy when a GPU is usable, NumPy otherwise.

``RAYSINGA_DEVICE=cpu`` forces NumPy; ``RAYSINGA_DEVICE=gpu`` demands CuPy and fails loudly when no
GPU is usable. CuPy is imported once, and the reason it could not be used is kept so that the error
raised later says why (missing wheel, no driver, no device) instead of a bare ImportError.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

_cupy: Any = None
_cupy_error: str | None = None
_probed = False


def _probe_cupy() -> None:
    global _cupy, _cupy_error, _probed
    if _probed:
        return
    _probed = True
    try:
        import cupy  # noqa: PLC0415 - optional dependency, probed once

        n = cupy.cuda.runtime.getDeviceCount()
        if n < 1:
            raise RuntimeError("CUDA reports no device")
        cupy.cuda.Device(0).compute_capability  # noqa: B018 - touches the driver
        _cupy = cupy
    except Exception as e:  # ImportError, CUDARuntimeError, driver errors ...
        _cupy_error = f"{type(e).__name__}: {e}"


def gpu_available() -> bool:
    """True when CuPy imports and at least one CUDA device answers."""
    _probe_cupy()
    return _cupy is not None


def gpu_unavailable_reason() -> str | None:
    _probe_cupy()
    return _cupy_error


def device() -> str:
    """The device the library computes on: ``"gpu"`` or ``"cpu"``."""
    want = os.environ.get("RAYSINGA_DEVICE", "").strip().lower()
    if want in ("", "auto"):
        return "gpu" if gpu_available() else "cpu"
    if want == "cpu":
        return "cpu"
    if want == "gpu":
        if not gpu_available():
            raise RuntimeError(
                "RAYSINGA_DEVICE=gpu but no GPU is usable: "
                f"{gpu_unavailable_reason()}. Install the CuPy wheel for your CUDA version "
                "(pip install 'raysinga[gpu]' for CUDA 12, 'raysinga[gpu-cuda13]' for CUDA 13) "
                "or set RAYSINGA_DEVICE=cpu."
            )
        return "gpu"
    raise ValueError(f"RAYSINGA_DEVICE must be 'cpu', 'gpu' or 'auto', got {want!r}")


def cupy_module() -> Any:
    """The cupy module; a clear error when it cannot be used."""
    if not gpu_available():
        raise RuntimeError(f"CuPy is not usable here: {gpu_unavailable_reason()}")
    return _cupy


def get_array_module(*arrays: Any) -> Any:
    """``cupy`` if any argument is a CuPy array, else ``numpy`` (as ``cupy.get_array_module``)."""
    for a in arrays:
        # By module name, so no CuPy import or device probe is needed to recognise NumPy input.
        if type(a).__module__.startswith("cupy"):
            return cupy_module()
    return np


def xp_for(dev: str | None = None) -> Any:
    """The array module for a device name (default: the current device)."""
    dev = dev or device()
    return cupy_module() if dev == "gpu" else np


def to_numpy(a: Any) -> np.ndarray:
    """A NumPy array from a NumPy or CuPy array (a copy only when the data lives on the GPU)."""
    if type(a).__module__.startswith("cupy"):
        return cupy_module().asnumpy(a)
    return np.asarray(a)


def to_device(a: Any, dev: str | None = None) -> Any:
    """The array on ``dev`` (default: the current device); no copy when already there."""
    return xp_for(dev).asarray(a)
