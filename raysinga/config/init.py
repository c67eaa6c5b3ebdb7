"""The job file's ``init`` section: how the names of a checkpoint given with ``--init-from`` map
onto this model's parameters, as :func:`raysinga.checkpoint.match` does (a prefix stripped
first, then renames: whole names, or prefixes where the old name ends in ``/``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .checks import ConfigError, mapping, section

INIT_KEYS = {
    "rename": "checkpoint name -> this model's name, for --init-from (a name ending in '/' "
    "renames every name it starts)",
    "strip_prefix": "removed from the front of each checkpoint name first, for --init-from",
}


@dataclass(frozen=True)
class InitConfig:
    rename: dict[str, str] = field(default_factory=dict)
    strip_prefix: str | None = None


def init_section(d: Any) -> InitConfig:
    d = section("init", d, INIT_KEYS)
    rename = mapping("init.rename", d.get("rename") or {})
    for old, new in rename.items():
        if not isinstance(new, str) or not new or not old:
            raise ConfigError(
                f"init.rename: expected names (text) on both sides, got {old!r}: {new!r}"
            )
        if old.endswith("/") != new.endswith("/"):
            raise ConfigError(
                f"init.rename: {old!r} -> {new!r}: a prefix (ending in '/') renames to a prefix"
            )
    strip = d.get("strip_prefix")
    if strip is not None and (not isinstance(strip, str) or not strip):
        raise ConfigError(f"init.strip_prefix: expected a name prefix (text), got {strip!r}")
    return InitConfig(dict(rename), strip)
