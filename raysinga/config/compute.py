"""How a run computes: the precision of its matrix products and how a GPU runs its steps (the
job's ``precision`` and ``gpu`` sections; ``docs/devices.md``)."""

from __future__ import annotations

from typing import Literal

from .section import Section, key


class PrecisionConfig(Section):
    compute: Literal["f32", "tf32", "bf16"] = key(
        "f32",
        description="the matrix products' operands: `f32`, `tf32` or `bf16`, summed in float32; "
        "everything else, and the servers' master weights and optimizer, stays float32 (see "
        "`docs/devices.md`; on a CPU the reduced ones are emulated)",
    )


class GpuConfig(Section):
    graphs: bool = key(
        False,
        description="record each training step as a CUDA graph and replay it (the single-process "
        "trainer on a GPU; `RAYSINGA_GPU_GRAPHS=1` or `0` overrides; see `docs/devices.md`)",
    )
