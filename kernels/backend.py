"""The one backend switch: CuPy when a GPU is usable, NumPy otherwise.

``RAYSINGA_DEVICE=cpu`` forces NumPy; ``RAYSINGA_DEVICE=gpu`` demands CuPy and fails loudly when no
GPU is usable. "Usable" is tried, not assumed: the probe finds a device, compiles a small CUDA
kernel with NVRTC, runs it and a cuBLAS matrix product, and checks their results, so that a driver
too old for the CuPy wheel, a missing NVRTC or cuBLAS library, or a broken device is found here
once, not in the middle of a run. The reason a GPU could not be used is kept, so that the error
raised later (or the one line an automatic choice prints) says why.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

_cupy: Any = None
_cupy_error: str | None = None
_cupy_installed = False
_probed = False

# Each extra brings CuPy with the NVRTC and cuBLAS libraries it needs, so a machine with only the
# NVIDIA driver computes on its GPU.
INSTALL_HINT = "pip install 'raysinga[gpu]' for CUDA 12, 'raysinga[gpu-cuda13]' for CUDA 13"

# y = 2x + 1 over n floats: small enough to compile in well under a second, and any missing
# piece of the toolchain (NVRTC, the driver's JIT, the launch path) fails it.
_PROBE_SOURCE = r"""
extern "C" __global__ void raysinga_probe(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i] + 1.0f;
}
"""


def _try_gpu(cupy: Any) -> None:
    """Raises, with the step that failed in the message, unless CuPy computes correctly here."""
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise RuntimeError(
            f"the CUDA runtime found no usable device ({type(e).__name__}: {e})"
        ) from None
    if n < 1:
        raise RuntimeError("CUDA reports no device")
    try:
        kernel = cupy.RawKernel(_PROBE_SOURCE, "raysinga_probe")
        x = cupy.arange(64, dtype=cupy.float32)
        y = cupy.empty_like(x)
        kernel((1,), (64,), (x, y, np.int32(64)))
        got = cupy.asnumpy(y)
    except Exception as e:
        raise RuntimeError(
            f"a test CUDA kernel did not compile or run ({type(e).__name__}: {e})"
        ) from None
    if not np.array_equal(got, 2 * np.arange(64, dtype=np.float32) + 1):
        raise RuntimeError("a test CUDA kernel ran but returned wrong values")
    try:
        a = cupy.full((16, 16), 0.5, dtype=cupy.float32)
        product = cupy.asnumpy(a @ a)
    except Exception as e:
        raise RuntimeError(f"cuBLAS failed a test product ({type(e).__name__}: {e})") from None
    if not np.all(product == 4.0):
        raise RuntimeError("cuBLAS returned a wrong test product")


def _probe_cupy() -> None:
    global _cupy, _cupy_error, _cupy_installed, _probed
    if _probed:
        return
    _probed = True
    try:
        import cupy  # noqa: PLC0415 - optional dependency, probed once
    except Exception as e:  # ImportError, or a wheel that fails to load its libraries
        _cupy_error = f"CuPy cannot be imported ({type(e).__name__}: {e})"
        return
    _cupy_installed = True
    try:
        _try_gpu(cupy)
    except Exception as e:
        _cupy_error = str(e)
        return
    _cupy = cupy


def _nvidia_driver_present() -> bool:
    return os.path.exists("/proc/driver/nvidia/version")


def gpu_available() -> bool:
    """True when CuPy imports and computes correctly on a CUDA device (see the module's doc)."""
    _probe_cupy()
    return _cupy is not None


def gpu_unavailable_reason() -> str | None:
    _probe_cupy()
    return _cupy_error


def gpu_fallback_note() -> str | None:
    """One line for a run whose automatic choice took the CPU although a GPU looked meant to be
    used (CuPy is installed, or an NVIDIA driver is): why, and what to do. ``None`` where the GPU
    is used, or where neither is there (a CPU machine needs no word)."""
    if gpu_available():
        return None
    if _cupy_installed:
        return (
            f"raysinga: computing on the CPU: CuPy is installed but the GPU is not usable: "
            f"{_cupy_error} (RAYSINGA_DEVICE=cpu silences this line)"
        )
    if _nvidia_driver_present():
        return (
            "raysinga: computing on the CPU: an NVIDIA driver is present but CuPy cannot be "
            f"used ({_cupy_error}); {INSTALL_HINT}"
        )
    return None


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
                f"RAYSINGA_DEVICE=gpu but no GPU is usable: {gpu_unavailable_reason()}. "
                f"Install CuPy with its CUDA libraries ({INSTALL_HINT}) or set RAYSINGA_DEVICE=cpu."
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
