"""The job file's ``divergence`` section: when a rising loss stops a run
(:mod:`raysinga.run.divergence` is the guard that applies it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checks import ConfigError, integer, section

DIVERGENCE_KEYS = {
    "factor": "stop when the mean loss of the last `window` samples trained is over this many "
    "times the early level (default 2; null: only NaN or infinite values stop the run)",
    "early_steps": "the early level is the mean loss of the run's first N steps, and for a "
    "classifier at least ln(classes) (default 3)",
    "window": "samples whose mean loss is checked: the newest steps (every group's) holding at "
    "least this many (default 256)",
}


@dataclass(frozen=True)
class DivergenceConfig:
    factor: float | None = 2.0
    early_steps: int = 3
    window: int = 256


def divergence_section(d: Any) -> DivergenceConfig:
    d = section("divergence", d, DIVERGENCE_KEYS)
    factor = d.get("factor", 2.0)
    if factor is not None and (
        isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1
    ):
        raise ConfigError(f"divergence.factor: expected a number > 1 or null, got {factor!r}")
    return DivergenceConfig(
        factor=None if factor is None else float(factor),
        early_steps=integer("divergence.early_steps", d.get("early_steps", 3), 1),
        window=integer("divergence.window", d.get("window", 256), 1),
    )
