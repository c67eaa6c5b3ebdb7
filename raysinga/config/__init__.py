"""The job: a YAML file (or a dict) in the spirit of SINGA's job.conf, read into typed,
validated sections. Every refusal names the key path (``updater.momentum``) and what was
expected, so that a typo fails at once rather than a hundred steps into a run."""

from __future__ import annotations

from .checks import ConfigError
from .job import (
    DATA_KEYS,
    DataConfig,
    FaultConfig,
    JobConfig,
    apply_overrides,
    from_dict,
    load,
    parse_yaml,
)
from .topology import Resources, Topology

__all__ = [
    "DATA_KEYS",
    "ConfigError",
    "DataConfig",
    "FaultConfig",
    "JobConfig",
    "Resources",
    "Topology",
    "apply_overrides",
    "from_dict",
    "load",
    "parse_yaml",
]
