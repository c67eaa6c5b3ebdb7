"""CUDA kernels of a user's own layer, built from source as raysinga builds its own.

A layer's forward and backward run on ``xp`` arrays; where an array op is not fast enough on a
GPU, the layer names a kernel here instead: :func:`elementwise` (a loop body over equal-shaped
arrays, CuPy's ``ElementwiseKernel``) or :func:`raw` (a ``__global__`` function from source).
Either is compiled by NVRTC with raysinga's options (``gpu_launch.NVRTC_OPTIONS``: no fused
multiply-adds, so a product is rounded as NumPy rounds it), once per device and dtype, and kept in
CuPy's kernel cache on disk, so a second process does not compile it again. Given NumPy arrays, the
kernel runs the layer's own NumPy function (``cpu=``) instead: one call in the layer, either device.

Nothing here imports CuPy until a CuPy array reaches a kernel, so a layer module that builds its
kernels at import time imports on a machine without a GPU.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .backend import cupy_module, get_array_module

_TYPES = {"float32": "float", "float64": "double"}


def _defined_at() -> str:
    """``file:line`` of the caller's caller: where a kernel was defined, for its errors."""
    f = sys._getframe(2)
    return f"{f.f_code.co_filename}:{f.f_lineno}"


class _Kernel:
    def __init__(self, name: str, cpu: Callable | None, where: str) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"a kernel's name must be a C identifier, got {name!r} ({where})")
        if cpu is not None and not callable(cpu):
            raise TypeError(f"kernel {name!r}: cpu= must be a function, got {cpu!r} ({where})")
        self.name, self.cpu, self.where = name, cpu, where
        self._built: dict[Any, Any] = {}

    def _on_cpu(self, args: tuple) -> Any:
        if self.cpu is None:
            raise TypeError(
                f"kernel {self.name!r} ({self.where}) was given NumPy arrays but has no CPU "
                "code: pass cpu= (a function of the same arguments) where it is defined"
            )
        return self.cpu(*args)

    def _compiled(self, key: Any, build: Callable[[], Any]) -> Any:
        cupy = cupy_module()
        key = (cupy.cuda.Device().id, key)
        if key not in self._built:
            try:
                self._built[key] = build()
            except Exception as e:  # CuPy's CompileException carries NVRTC's log
                raise RuntimeError(
                    f"kernel {self.name!r} ({self.where}) did not compile: {e}"
                ) from None
        return self._built[key]


class Elementwise(_Kernel):
    """An element-wise kernel: see :func:`elementwise`."""

    def __init__(self, in_params, out_params, operation, name, cpu, preamble, where) -> None:
        super().__init__(name, cpu, where)
        self.in_params, self.out_params = in_params, out_params
        self.operation, self.preamble = operation, preamble
        self.n_out = len([p for p in out_params.split(",") if p.strip()])
        if self.n_out < 1:
            raise ValueError(f"kernel {name!r} ({where}) declares no output")

    def __call__(self, *args: Any) -> Any:
        if get_array_module(*args) is not np:
            return self._kernel()(*args)
        out = self._on_cpu(args)
        got = len(out) if isinstance(out, tuple) else 1
        if got != self.n_out:
            raise TypeError(
                f"kernel {self.name!r} ({self.where}): its CPU code returned {got} "
                f"array{'s' * (got != 1)}, the kernel declares {self.n_out} outputs"
            )
        return out

    def _kernel(self) -> Any:
        def build() -> Any:
            from .gpu_launch import NVRTC_OPTIONS  # noqa: PLC0415 - imports CuPy

            return cupy_module().ElementwiseKernel(
                self.in_params,
                self.out_params,
                self.operation,
                name=self.name,
                preamble=self.preamble,
                options=NVRTC_OPTIONS,
            )

        return self._compiled(None, build)


class Raw(_Kernel):
    """A raw kernel: see :func:`raw`."""

    def __init__(self, source, name, cpu, per, where) -> None:
        super().__init__(name, cpu, where)
        if per not in ("item", "block"):
            raise ValueError(
                f"kernel {name!r} ({where}): per must be 'item' or 'block', got {per!r}"
            )
        self.source, self.per = source, per

    def __call__(self, n: int, *args: Any) -> None:
        if get_array_module(*args) is np:
            self._on_cpu(args)
            return
        from .gpu_launch import launch, launch_blocks  # noqa: PLC0415 - imports CuPy

        dtypes = {str(a.dtype) for a in args if type(a).__module__.startswith("cupy")}
        floats = sorted(dtypes & set(_TYPES))
        if len(floats) != 1:
            raise TypeError(
                f"kernel {self.name!r} ({self.where}) needs its float arrays all float32 or all "
                f"float64 (T in its source), got {sorted(dtypes) or 'no CuPy array'}"
            )
        for i, a in enumerate(args):
            if type(a).__module__.startswith("cupy") and not a.flags.c_contiguous:
                raise TypeError(
                    f"kernel {self.name!r} ({self.where}): argument {i} is not C-contiguous "
                    "(a raw kernel indexes flat memory: pass cupy.ascontiguousarray of it)"
                )
        kernel = self._function(floats[0])
        t = np.dtype(floats[0]).type  # a Python float is passed as T, not always as a double
        args = tuple(t(a) if isinstance(a, float) else a for a in args)
        (launch if self.per == "item" else launch_blocks)(kernel, int(n), *args)

    def source_for(self, dtype: str) -> str:
        """The source compiled for ``dtype`` (``"float32"`` or ``"float64"``): the user's, with
        ``T`` defined first. A test can compile it with ``nvcc`` on a machine without a GPU."""
        return f"typedef {_TYPES[str(dtype)]} T;\n{self.source}"

    def _function(self, dtype: str) -> Any:
        def build() -> Any:
            from .gpu_launch import NVRTC_OPTIONS  # noqa: PLC0415 - imports CuPy

            module = cupy_module().RawModule(code=self.source_for(dtype), options=NVRTC_OPTIONS)
            return module.get_function(self.name)

        return self._compiled(dtype, build)


def elementwise(
    in_params: str,
    out_params: str,
    operation: str,
    *,
    name: str,
    cpu: Callable | None,
    preamble: str = "",
) -> Elementwise:
    """A kernel that runs ``operation`` (CUDA C++) once per element, as CuPy's
    ``ElementwiseKernel`` with raysinga's NVRTC options. ``in_params`` and ``out_params`` declare
    the arguments (``"T a, T b"``, ``"T y"``; ``T`` takes the arrays' dtype). Called with CuPy
    arrays it returns the new output array (a tuple for several); called with NumPy arrays it
    returns ``cpu(*args)``, which must give as many arrays."""
    return Elementwise(in_params, out_params, operation, name, cpu, preamble, _defined_at())


def raw(source: str, name: str, *, cpu: Callable | None, per: str = "item") -> Raw:
    """A ``extern "C" __global__`` function ``name`` from CUDA ``source``, in which ``T`` is
    the arrays' float type (``float`` or ``double``: compiled once for each). Called as
    ``kernel(n, *args)``: with CuPy arrays it launches 256-thread blocks, ``per="item"`` enough
    for a grid-stride loop over ``n`` items, ``per="block"`` one block per row of ``n`` rows
    (up to 65,535; loop over the rest). Python ints arrive as ``long long``, Python floats as
    ``T``, arrays as flat C-contiguous memory (another layout is refused: the kernel could not
    see it). With NumPy arrays it calls ``cpu(*args)``. Either way the kernel writes its outputs
    into arrays it is given and returns nothing."""
    return Raw(source, name, cpu, per, _defined_at())
