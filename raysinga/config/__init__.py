"""The job: a YAML file (or a dict) in the spirit of SINGA's job.conf, read into typed,
validated sections. Every key's type, default, bounds and meaning are stated once, in the
schema (:mod:`.job`, :mod:`.topology`); a refusal is one line naming the key path
(``updater.momentum``) and what was expected, so that a typo fails at once rather than a
hundred steps into a run (:mod:`.section`)."""

from __future__ import annotations

from .files import apply_overrides, load, parse_yaml
from .job import (
    DATA_KEYS,
    CheckpointConfig,
    DataConfig,
    DivergenceConfig,
    FaultConfig,
    HoldOut,
    InitConfig,
    JobConfig,
    from_dict,
)
from .section import ConfigError
from .topology import Resources, Topology, TopologyError

__all__ = [
    "DATA_KEYS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DivergenceConfig",
    "FaultConfig",
    "HoldOut",
    "InitConfig",
    "JobConfig",
    "Resources",
    "Topology",
    "TopologyError",
    "apply_overrides",
    "from_dict",
    "load",
    "parse_yaml",
]
